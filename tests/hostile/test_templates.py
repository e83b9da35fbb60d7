"""Hostile chat templates: every error one line naming the record, a hang stopped, a bomb refused before the tokenizer.

Found by a hostile run (issue 28 item 5): Python errors escaped the sandboxed render as tracebacks (``{{ 1/0 }}``,
``{% include %}``, ``range(10**6)``, a macro calling itself), nested loops hung calibrate, and an output bomb
aborted the whole process inside the tokenizers library (a Rust allocation failure). A template now renders in a
child interpreter (quality/chat_template.py) under a deadline, a memory cap and an output cap.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.errors import TokenizerError
from hpu_fp8_loader.quality.chat_template import ChatRenderer

TEMPLATE_FILE = "chat_template.jinja"
MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."}]
GOOD = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

# id -> (template, what the one line says after "fails on this record"). Each raised a traceback, hung or crashed.
FAILING_ON_A_RECORD = {
    "division-by-zero": ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    "include": ("{% include 'other.jinja' %}", "includes or imports the template 'other.jinja'"),
    "import": ("{% import 'macros.jinja' as m %}{{ m.x() }}", "includes or imports the template 'macros.jinja'"),
    "extends": ("{% extends 'base.jinja' %}", "includes or imports the template 'base.jinja'"),
    "range-past-the-sandbox": ("{{ range(10**6)|list|length }}", "Range too big"),
    "recursive-macro": ("{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}", "recurses too deeply"),
    "recursive-loop": ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "recurses too deeply"),
    "multiplication-bomb": ("{{ 'x' * 10**10 }}", "MiB of memory"),
    "format-bomb": ("{{ '%9999999999d' % 1 }}", "MiB of memory"),
    "filter-bomb": ("{{ 'x'|center(10**10) }}", "MiB of memory"),
    "method-bomb": ("{{ 'x'.ljust(10**10) }}", "MiB of memory"),
    "tojson-bomb": ("{{ messages|tojson(indent=10**10) }}", "MiB of memory"),
    "streamed-output-bomb": ("{% for a in range(99999) %}{{ 'x' * 99999 }}{% endfor %}", "more than 8,388,608 characters"),
    "namespace-doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "MiB of memory",
    ),
    "type-error": ("{{ 1 + 'a' }}", "TypeError"),
    "unsafe-attribute": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "mutating-a-message": ("{{ messages.append(1) }}", "unsafe"),
    "undefined-call": ("{{ messages[0].nothing() }}", "has no attribute 'nothing'"),
    "raise-exception": ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    "key-error": ("{{ {}['missing'].x }}", "has no attribute 'missing'"),
}
# id -> (template, what the one line says after "does not parse"): refused before any dataset is read.
NOT_PARSING = {
    "syntax-error": ("{% for %}", "Expected an expression"),
    "unknown-filter": ("{{ messages|no_such_filter }}", "No filter named 'no_such_filter'"),
    "unclosed-block": ("{% if true %}", "Unexpected end of template"),
    "nested-too-deeply": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nests or recurses too deeply"),
}
# Loops that would run for hours: stopped at the deadline.
HANGING = {
    "nested-ranges": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
    "nested-messages-and-ranges": "{% for m in messages %}{% for a in range(99999) %}{% for b in range(99999) %}"
    "{% endfor %}{% endfor %}{% endfor %}",
}


@pytest.fixture
def model(tmp_path, source_factory) -> Path:
    """A private copy of the byte-level qwen2 source (vocab 512: byte tokens) with a chats.jsonl dataset beside it."""
    root = tmp_path / "model"
    shutil.copytree(source_factory("qwen2-tiny", "paddle"), root)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(3)))
    return root


def calibrate(model: Path):
    return run_cli(
        "calibrate", model, "-o", model.parent / "m.json", "--dataset", model.parent / "chats.jsonl",
        "--chat-template", "--samples", "1", "--seq-len", "16", "-q",
    )  # fmt: skip


def _refused_by_calibrate(model: Path, template: str, *named: str) -> str:
    (model / TEMPLATE_FILE).write_text(template)
    before = tree_digest(model.parent)
    line = assert_refused(calibrate(model), TEMPLATE_FILE, *named)
    assert tree_digest(model.parent) == before  # nothing written: no m.json, no staging file
    return line


# What the command shows, for one case of each kind in the inner loop and for every case in the whole suite.
THROUGH_THE_COMMAND = ["division-by-zero", "multiplication-bomb", "syntax-error"]


def _marked(cases: dict[str, tuple[str, str]]) -> list:
    """Every case of ``cases``, those not in THROUGH_THE_COMMAND marked slow."""
    return [
        pytest.param(*case, id=key, marks=() if key in THROUGH_THE_COMMAND else pytest.mark.slow) for key, case in cases.items()
    ]


@pytest.mark.parametrize(("template", "named"), _marked(FAILING_ON_A_RECORD))
def test_a_template_failing_on_a_record_is_one_line_naming_the_record(model, template, named):
    line = _refused_by_calibrate(model, template, "chats.jsonl:1", named)
    assert "fails on this record" in line


@pytest.mark.parametrize(("template", "named"), FAILING_ON_A_RECORD.values(), ids=FAILING_ON_A_RECORD.keys())
def test_the_renderer_names_the_record_for_every_failing_template(template, named):
    render = ChatRenderer(template, Path(TEMPLATE_FILE), {}, memory_bytes=2**28)  # a bomb fails sooner
    with render, pytest.raises(TokenizerError) as raised:
        render(MESSAGES, "chats.jsonl:3")
    line = str(raised.value)
    assert line.startswith(f"chats.jsonl:3: the chat template of {TEMPLATE_FILE} fails on this record (")
    assert named in line and "\n" not in line and "Traceback" not in line


@pytest.mark.parametrize(("template", "named"), NOT_PARSING.values(), ids=NOT_PARSING.keys())
def test_the_renderer_refuses_a_template_that_does_not_parse_when_it_is_made(template, named):
    with pytest.raises(TokenizerError) as raised:
        ChatRenderer(template, Path(TEMPLATE_FILE), {})
    assert str(raised.value).startswith(f"{TEMPLATE_FILE}: the chat template does not parse (") and named in str(raised.value)


@pytest.mark.parametrize(("template", "named"), _marked(NOT_PARSING))
def test_a_template_that_does_not_parse_is_refused_before_the_dataset_is_read(model, template, named):
    (model.parent / "chats.jsonl").unlink()  # never read: the template is refused first
    line = _refused_by_calibrate(model, template, "does not parse", named)
    assert "chats.jsonl" not in line


@pytest.mark.slow
@pytest.mark.parametrize("template", HANGING.values(), ids=HANGING.keys())
def test_a_template_that_loops_for_hours_is_stopped_at_the_deadline(model, template):
    """What the command does, with the default deadline (10 s)."""
    _refused_by_calibrate(model, template, "chats.jsonl:1", "not finished within 10 s")


@pytest.mark.parametrize(
    "template", [HANGING["nested-ranges"], pytest.param(HANGING["nested-messages-and-ranges"], marks=pytest.mark.slow)]
)
def test_the_deadline_really_interrupts_a_render(template):
    with ChatRenderer(template, Path(TEMPLATE_FILE), {}, seconds=0.5) as render:
        with pytest.raises(TokenizerError, match=r"^d\.jsonl:7: the chat template of .* \(not finished within 0\.5 s"):
            render(MESSAGES, "d.jsonl:7")
        child = render._child
        assert child is None  # killed; the next record gets a fresh child


def test_a_renderer_goes_on_after_a_failing_record_and_after_a_killed_one():
    template = "{% if messages[0].content == 'hang' %}{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}" \
        "{% endfor %}{% elif messages[0].content == 'fail' %}{{ 1/0 }}{% endif %}{{ messages[0].content }}"  # fmt: skip
    with ChatRenderer(template, Path(TEMPLATE_FILE), {}, seconds=0.5) as render:
        assert render([{"role": "user", "content": "one"}], "d.jsonl:1") == "one"
        with pytest.raises(TokenizerError, match=r"^d\.jsonl:2: .*ZeroDivisionError"):
            render([{"role": "user", "content": "fail"}], "d.jsonl:2")
        assert render([{"role": "user", "content": "two"}], "d.jsonl:3") == "two"
        with pytest.raises(TokenizerError, match=r"^d\.jsonl:4: .*not finished within 0\.5 s"):
            render([{"role": "user", "content": "hang"}], "d.jsonl:4")
        assert render([{"role": "user", "content": "three"}], "d.jsonl:5") == "three"


def test_the_output_limit_counts_characters_of_one_record():
    with ChatRenderer("{{ 'x' * messages[0].content|int }}", Path(TEMPLATE_FILE), {}, characters=100) as render:
        assert render([{"role": "user", "content": "100"}], "r") == "x" * 100
        with pytest.raises(TokenizerError, match=r"^r: .*more than 100 characters for one record"):
            render([{"role": "user", "content": "101"}], "r")


def test_the_memory_limit_is_the_childs_not_this_processs():
    """A 300 MB string fails under a 64 MiB cap in the child, and this process never allocated it."""
    render = ChatRenderer("{{ ('x' * 300000000)|length }}", Path(TEMPLATE_FILE), {}, memory_bytes=2**26)
    with render, pytest.raises(TokenizerError, match=r"needs more than 64 MiB of memory"):
        render(MESSAGES, "r")
    with ChatRenderer("{{ ('x' * 300000)|length }}", Path(TEMPLATE_FILE), {}, memory_bytes=2**26) as render:
        assert render(MESSAGES, "r") == "300000"


def test_a_child_killed_from_outside_is_named_as_died():
    """kill -9 of the child (the out-of-memory killer) between records: one line saying so, not a hang or a traceback."""
    with ChatRenderer(HANGING["nested-ranges"], Path(TEMPLATE_FILE), {}, seconds=60) as render:
        assert render._child is not None
        pid = render._child.process.pid
        os.kill(pid, 9)
        with pytest.raises(TokenizerError, match=r"the process rendering it died \(killed by signal 9"):
            render(MESSAGES, "r")


def test_close_ends_the_child():
    render = ChatRenderer(GOOD, Path(TEMPLATE_FILE), {})
    assert render._child is not None
    process = render._child.process
    assert render(MESSAGES, "r") == "<user>Hello there<assistant>Hi."
    render.close()
    assert process.poll() is not None


def test_a_good_template_still_calibrates(model):
    (model / TEMPLATE_FILE).write_text(GOOD)
    result = calibrate(model)
    assert result.exit_code == 0, result.stderr
    assert (model.parent / "m.json").is_file()
