"""Shared test helpers, not tests: the models' published configurations, a Hub cache laid out on disk,
damage done to a checkpoint in place."""
