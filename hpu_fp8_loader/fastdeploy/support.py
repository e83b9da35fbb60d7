"""Which FastDeploy and which paddle the hook supports: the one place the package says it.

``hpu-fp8 doctor`` compares the FastDeploy it finds with these constants, and docs/fastdeploy.md
(section 1) states them in prose; a change of the supported range is a change here first.

How each fact was established (FastDeploy's git history as mirrored by the fork
``fmiao2372/FastDeploy``, whose ``develop`` carries upstream's up to 2026-01-09):

* PR 5324, the HPU tensor-wise FP8 path the hook targets, is the merge ``404cf0ec`` on ``develop``
  (``git log``); ``git branch --contains`` names ``develop`` and two branches cut from it, and the
  history holds no release tag at all. Releases are therefore stated by date only [inferred]:
  2.3 predates any HPU FP8 code, release/2.4 was cut before the merge.
* A ``develop`` build names itself ``2.4.0-dev`` from ``3066a0c3`` (2025-12-08, ``setup.py``), before
  PR 5324 and through the checked commit, so a version alone cannot tell a supported ``develop``
  from an older one: the commit in ``version.txt`` (``build.sh`` writes it) and FastDeploy's own
  sources (the HPU FP8 MoE method) decide.
* ``fastdeploy/__init__.py`` calls ``paddle.compat.enable_torch_proxy`` at every ``develop`` commit
  from ``131defa1`` (2025-12-22, ``git log -S enable_torch_proxy``), so importing FastDeploy needs a
  paddle that has it: the paddlepaddle 3.1.1 wheel has no ``paddle.compat`` at all, 3.2.2's has no
  ``enable_torch_proxy``, 3.3.0's has both (the wheels' contents, read here). FastDeploy's Gaudi
  guide (``docs/get_started/installation/intel_gaudi.md@c2c1942d``) and its HPU CI script still
  install 3.1.1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CHECKED_COMMITS",
    "EXPORT_LEGACY_TP_COMMIT",
    "FASTDEPLOY_RELEASES",
    "FIRST_SUPPORTED_COMMIT",
    "PADDLE_CALLS",
    "PADDLE_MINIMUM",
    "PR_5324",
    "PR_5757",
    "SUPPORTED_BRANCH",
    "FastDeployCommit",
    "PaddleCall",
    "Release",
    "release_verdict",
    "render_versions",
]


@dataclass(frozen=True)
class FastDeployCommit:
    """A commit of FastDeploy's ``develop`` that matters to the hook."""

    commit: str  # 40 hex digits
    date: str  # commit date, YYYY-MM-DD
    title: str  # its first line
    carries: tuple[str, ...]  # the pull requests the hook depends on that this commit includes
    why: str  # what it means for the hook

    @property
    def short(self) -> str:
        return self.commit[:8]


SUPPORTED_BRANCH = "develop"
"""FastDeploy's branch that carries the HPU FP8 path; no release tag in the history read contains it."""

PR_5324 = "PR 5324 (HPU tensor-wise FP8)"
PR_5757 = "PR 5757 (v0 TP split of expert weight scales, paired)"

FIRST_SUPPORTED_COMMIT = FastDeployCommit(
    commit="404cf0ece44d4f81fad770359a73d2762947d05d",
    date="2025-12-17",
    title="[Intel HPU] enable tensor_wise_fp8 (#5324)",
    carries=(PR_5324,),
    why="the merge of PR 5324: the oldest develop commit with the HPU FP8 linear, MoE and KV-cache methods the hook "
    "fills; not run by the conformance suite [inferred from the sources]",
)

CHECKED_COMMITS: tuple[FastDeployCommit, ...] = (
    FastDeployCommit(
        commit="8c3513a410df00ae6a13a7c87f16c2888e2cdeac",
        date="2026-01-09",
        title='Revert "[TSP] last_norm allgather move to model.py (#5924)" (#5961)',
        carries=(PR_5324, PR_5757),
        why="the conformance suite runs the hook against FastDeploy's own loading at this commit, on a CPU "
        "(tests/fastdeploy_real); not yet on a Gaudi",
    ),
)
"""Commits the conformance suite checks the hook against, newest last. A newer commit is "unknown-newer": it may
carry PR 5855 (its MoE layout is supported, re-created by the suite on the last checked commit), no commit of which
is in the history read."""

EXPORT_LEGACY_TP_COMMIT = FastDeployCommit(
    commit="44a13e4557ba2eabcedcc85b276f56c586d952a5",
    date="2025-12-30",
    title="[Feature] support w4afp8 v1_loader and v0_loader(tp>1) (#5757)",
    carries=(PR_5324, PR_5757),
    why="from here FastDeploy's v0 loader splits an expert's up_gate_proj weight scale as gate|up pairs; "
    "export-legacy at TP > 1 relies on it (the hook itself does not)",
)


@dataclass(frozen=True)
class Release:
    """A FastDeploy release line and whether it carries the HPU FP8 path, by date only (no tag was readable)."""

    version: str  # major.minor
    carries_pr_5324: bool
    evidence: str


FASTDEPLOY_RELEASES: tuple[Release, ...] = (
    Release("2.3", False, "cut 2025-11 with BF16 HPU support only; no intel_hpu/quantization in its tree [inferred]"),
    Release("2.4", False, "release/2.4 existed by 2025-12-15, before the PR 5324 merge (2025-12-17) [inferred]"),
    Release("2.5", True, "cut after 2026-01, months after PR 5324 (and PR 5855) merged on develop [inferred, unchecked]"),
)


@dataclass(frozen=True)
class PaddleCall:
    """A paddle attribute FastDeploy calls, where it calls it, and the oldest paddle that has it."""

    attribute: str  # dotted, from ``paddle``
    fastdeploy_file: str  # relative to the fastdeploy package
    since: str  # the develop commit (short) from which FastDeploy calls it
    paddle_minimum: str


PADDLE_CALLS: tuple[PaddleCall, ...] = (PaddleCall("paddle.compat.enable_torch_proxy", "__init__.py", "131defa1", "3.3.0"),)
"""What FastDeploy's import calls of paddle that older paddles lack; doctor checks each one the sources call."""

PADDLE_MINIMUM = "3.3.0"
"""The oldest paddle that imports the checked FastDeploy (``paddle.compat.enable_torch_proxy``); FastDeploy's Gaudi
guide says 3.1.1, whose wheel has no ``paddle.compat``: install this one with a PaddleCustomDevice intel_hpu build made
against it [not yet seen on a Gaudi]."""


def _release_line(version: str) -> tuple[int, int] | None:
    parts = version.split("-", 1)[0].split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def release_verdict(version: str) -> tuple[str, Release | None]:
    """For FastDeploy's reported version: ("develop", None) for a -dev build (the commit decides), ("release", the
    known Release), ("older", None) before 2.3, ("newer", None) after the last known line, ("unknown", None)."""
    if "dev" in version:
        return "develop", None
    line = _release_line(version)
    if line is None:
        return "unknown", None
    for release in FASTDEPLOY_RELEASES:
        if _release_line(release.version) == line:
            return "release", release
    first, last = _release_line(FASTDEPLOY_RELEASES[0].version), _release_line(FASTDEPLOY_RELEASES[-1].version)
    assert first is not None and last is not None
    return ("older", None) if line < first else ("newer", None)


def render_versions() -> str:
    """Which FastDeploy and which paddle, as a reader of the README and docs/fastdeploy.md needs it: rendered from
    the constants above (scripts/render_readme.py), so that the documents and ``hpu-fp8 doctor`` agree."""
    checked = CHECKED_COMMITS[-1]
    first = FIRST_SUPPORTED_COMMIT
    call = PADDLE_CALLS[0]
    releases = ", ".join(f"{r.version} {'carries' if r.carries_pr_5324 else 'lacks'} it" for r in FASTDEPLOY_RELEASES)
    return (
        f"- **FastDeploy**: `{SUPPORTED_BRANCH}` at `{checked.short}` ({checked.date}), checked against its own loading "
        f"on a CPU, not yet on a Gaudi: `git checkout {checked.commit}`. Any `{SUPPORTED_BRANCH}` commit from "
        f"`{first.short}` ({first.date}, {PR_5324}) should serve [inferred]; FastDeploy with PR 5855's MoE layout is "
        f"supported too. Releases, by date only [inferred]: {releases}. `hpu-fp8 doctor` compares the commit in "
        "FastDeploy's `version.txt` with this range.\n"
        f"- **paddle**: {PADDLE_MINIMUM} or newer. FastDeploy's `{call.fastdeploy_file}` calls `{call.attribute}` "
        f"(from `{call.since}` on), which paddle 3.1.1, the version FastDeploy's Gaudi guide installs, lacks: install "
        f"paddlepaddle>={PADDLE_MINIMUM} and a PaddleCustomDevice `intel_hpu` wheel built against it [not yet seen on a "
        "Gaudi]. `hpu-fp8 doctor` checks that paddle has what FastDeploy calls.\n"
    )
