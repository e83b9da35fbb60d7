"""Hostile inputs: every test tries to break a command and asserts a named refusal with nothing lost (issue 14)."""
