"""docs/spec.md and the validator name the same rules: a rule in one and not the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

import hpu_fp8_loader.checks.validate as validate_module

ROOT = Path(__file__).resolve().parents[1]


def test_every_documented_rule_is_enforced_and_every_enforced_rule_is_documented():
    documented = set(re.findall(r"\*\*([a-z0-9-]+\.[a-z0-9-]+)\*\*", (ROOT / "docs" / "spec.md").read_text()))
    source = Path(validate_module.__file__).read_text()
    enforced = set(re.findall(r'(?:report\.add|Violation)\(\s*"([a-z0-9-]+\.[a-z0-9-]+)"', source))
    assert documented == enforced
    assert len(enforced) >= 14
