"""Which FastDeploy and which paddle the hook supports: the one place the package says it.

``hpu-fp8 doctor`` compares the FastDeploy it finds with these constants, and docs/fastdeploy.md
(section 1) renders them; a change of the supported range is a change here first.

How each fact was established (git histories: the fork ``fmiao2372/FastDeploy``, whose ``develop`` carries
upstream's up to 2026-01-09, and the fork ``gongshaotian/FastDeploy``, which carries upstream ``develop`` to
e53f5184 and the heads of ``release/2.5`` and ``release/2.6``):

* PR 5324, the HPU tensor-wise FP8 path the hook targets, is the merge ``404cf0ec`` on ``develop``.
  2.3 predates any HPU FP8 code and release/2.4 was cut before the merge [inferred, by date]; release/2.5
  (cut from ``335ab70b``, 2026-02-10) and release/2.6 (from ``e3aed6de``, 2026-04-03) contain it and every
  change of ``CHANGES`` before their cut (``git merge-base --is-ancestor``).
* The version a build writes into ``version.txt`` is setup.py's ``FASTDEPLOY_VERSION`` default: ``2.4.0-dev``
  on develop from ``3066a0c3`` through 8c3513a4, ``2.6.0-dev`` at e53f5184, ``2.5.0`` and ``2.6.0`` on the release
  heads. A ``-dev`` version alone cannot tell one develop commit from another: the commit in ``version.txt``
  and FastDeploy's own sources decide.
* ``fastdeploy/__init__.py`` calls ``paddle.compat.enable_torch_proxy`` at every ``develop`` commit from
  ``131defa1`` (2025-12-22) to ``8b6bbb35`` (2026-03-24), and from there (release/2.5: its cherry-pick
  ``d12aa284``) ``paddle.enable_compat``, only where no torch is installed. The paddlepaddle 3.1.1 wheel has no
  ``paddle.compat``, 3.2.2's has neither name, 3.3.0's has both (the wheels' contents, read here). FastDeploy's
  Gaudi guide (``docs/get_started/installation/intel_gaudi.md``, at every build of ``BUILDS``) still installs 3.1.1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BUILDS",
    "CHANGES",
    "CHECKED_COMMITS",
    "CI_BUILD",
    "EXPORT_LEGACY_TP_COMMIT",
    "FASTDEPLOY_RELEASES",
    "FIRST_SUPPORTED_COMMIT",
    "PADDLE_CALLS",
    "PADDLE_MINIMUM",
    "PR_5324",
    "PR_5757",
    "PR_5855",
    "PR_5880",
    "RECOMMENDED_BUILD",
    "SUPPORTED_BRANCH",
    "FastDeployBuild",
    "FastDeployChange",
    "FastDeployCommit",
    "PaddleCall",
    "Release",
    "build_for_version",
    "release_verdict",
    "render_builds",
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

PR_5855 = "PR 5855 (HPU MoE EP; down_proj_in_scale an [E, 1] parameter)"
PR_5880 = "PR 5880 (Qwen3's q/k norms under self_attn.qk_norm)"


@dataclass(frozen=True)
class FastDeployBuild:
    """A FastDeploy as users build it (its Gaudi guide: from source, ``bash build.sh``): a branch head."""

    name: str  # the branch, as users name it
    commit: FastDeployCommit
    version: str  # setup.py's FASTDEPLOY_VERSION default, which the build writes into fastdeploy/version.txt
    moe_layout: str  # "list" (PR 5324 up to PR 5855) or "parameter" (from PR 5855)
    qwen3: str  # how Qwen3's q/k norms reach the HPU attention there
    moe_gate: str  # the dtype of the Qwen3-MoE router gate FastDeploy builds there


LIST, PARAMETER = "list", "parameter"
_NORMS_OWN = "the attention's own; FastDeploy's runner hands them to the fused attention"
_NORMS_HELD = "under `qk_norm`: FastDeploy's own loading hands the fused attention none, the hook hands them (section 14)"

BUILDS: tuple[FastDeployBuild, ...] = (
    FastDeployBuild(
        "develop",
        FastDeployCommit(
            "8c3513a410df00ae6a13a7c87f16c2888e2cdeac",
            "2026-01-09",
            'Revert "[TSP] last_norm allgather move to model.py (#5924)" (#5961)',
            (PR_5324, PR_5757),
            "the conformance suite runs it opt-in (and in CI where only the fmiao2372/FastDeploy mirror is found), on a CPU",
        ),
        "2.4.0-dev",
        LIST,
        _NORMS_OWN,
        "float32",
    ),
    FastDeployBuild(
        "release/2.5",
        FastDeployCommit(
            "f3fb7e032cad403061258cfb0a2b5e228ac31465",
            "2026-04-14",
            "[KSM] fix the bug in topk (#7397)",
            (PR_5324, PR_5757, PR_5855, PR_5880),
            "release/2.5's head (cut from develop 335ab70b, 2026-02-10): the conformance suite's CI build, on a CPU",
        ),
        "2.5.0",
        PARAMETER,
        _NORMS_HELD,
        "float32",
    ),
    FastDeployBuild(
        "release/2.6",
        FastDeployCommit(
            "7198b5883a0ebdc85b91a455aa07d0856911c9a7",
            "2026-06-01",
            "[RL] Fix the incorrect routing of EOS tokens, which leads to changes in accuracy (#7960)",
            (PR_5324, PR_5757, PR_5855, PR_5880),
            "release/2.6's head (cut from develop e3aed6de, 2026-04-03): the conformance suite runs it opt-in, on a CPU",
        ),
        "2.6.0",
        PARAMETER,
        _NORMS_HELD,
        "bfloat16 (float32 with --moe-gate-fp32)",
    ),
    FastDeployBuild(
        "develop",
        FastDeployCommit(
            "e53f5184acbb766f88475c8ead86986b6ac3b480",
            "2026-04-15",
            "PD deployment support without router (#7412)",
            (PR_5324, PR_5757, PR_5855, PR_5880),
            "develop after release/2.6 was cut: the conformance suite runs it opt-in, on a CPU",
        ),
        "2.6.0-dev",
        PARAMETER,
        _NORMS_HELD,
        "bfloat16 (float32 with --moe-gate-fp32)",
    ),
)
"""The FastDeploy builds the conformance suite checks the hook against, oldest first (docs/fastdeploy.md section 1)."""

CHECKED_COMMITS: tuple[FastDeployCommit, ...] = tuple(build.commit for build in BUILDS)
CI_BUILD = BUILDS[1]
"""The build CI's conformance suite runs (.ci/run names its commit; a test checks they agree): the one users are told
to take, one build's run being what fits CI's time; the others run opt-in (scripts/conformance_builds.py). Where
.ci/run finds only the mirror of fmiao2372/FastDeploy, it runs BUILDS[0] from there."""
RECOMMENDED_BUILD = BUILDS[1]
"""The build a Gaudi user should take (docs/fastdeploy.md "For users"): a release, with PR 5855 (EP) and Qwen3-MoE's
router gate in float32 as FastDeploy's HPU MoE kernel was always handed it (2.6 makes it bf16 unless
--moe-gate-fp32, which no Gaudi run has shown the kernel to take)."""


@dataclass(frozen=True)
class FastDeployChange:
    """A develop commit after PR 5324 that changes what the hook meets, and its cherry-picks onto a release."""

    commit: FastDeployCommit
    cherry_picks: tuple[str, ...] = ()  # full hashes of the same change on a release branch


CHANGES: tuple[FastDeployChange, ...] = (
    FastDeployChange(
        FastDeployCommit(
            "2533836dbb50b3f23a7006c4b9808ec9325e44d4",
            "2026-01-12",
            "[Optimization] Accelerate Qwen3 QK RMSNorm via Fused Triton Kernel (#5880)",
            (PR_5880,),
            "Qwen3's q/k norms move under self_attn.qk_norm and FastDeploy's HPU runner stops handing them to the fused "
            "attention; the hook fills them there and hands them back",
        )
    ),
    FastDeployChange(
        FastDeployCommit(
            "93b7675a64424db0a3a2b971aa2f823271da7333",
            "2026-01-14",
            "[Feature]Report FD statistical information (#5646)",
            (),
            "worker rank 0 reports its config to FastDeploy's usage server unless DO_NOT_TRACK=1",
        )
    ),
    FastDeployChange(
        FastDeployCommit(
            "fbcccaa750af6a6f81be85c4c4da38f8c6ab17fc",
            "2026-01-15",
            "[Intel HPU] enable MoE EP for hpu (#5855)",
            (PR_5855,),
            "the MoE layer holds down_proj_in_scale as an [E, 1] parameter (padded after loading); EP on the HPU",
        )
    ),
    FastDeployChange(
        FastDeployCommit(
            "6d33d5e370aa2bb4210fc10b2db7e7b21cf23011",
            "2026-01-28",
            "[Models][BugFix] shared experts and dense mlp layer do not require TP split (#6180)",
            (),
            "with sequence-parallel MoE (EP and TP > 1) ERNIE's shared experts are built unsplit: the hook refuses "
            "sequence-parallel MoE, the recipe turns it off",
        )
    ),
    FastDeployChange(
        FastDeployCommit(
            "53aaac69da2e391848593c9db117150286c0b2be",
            "2026-02-26",
            "[Optimization] Enable BF16 gate computation for GLM and Qwen (#6457)",
            (),
            "Qwen3-MoE's router gate is built in bf16 unless --moe-gate-fp32; the hook casts the float32 router as "
            "FastDeploy's own loading does [a bf16 gate not yet seen on a Gaudi's MoE kernel]",
        )
    ),
    FastDeployChange(
        FastDeployCommit(
            "8b6bbb3504fa5e5269b381bb32c59c388c16560f",
            "2026-03-24",
            "[Optimization] Use a separate driver when using Triton with Paddle (#6897)",
            (),
            "fastdeploy/__init__.py calls paddle.enable_compat only where torch is not installed, instead of "
            "paddle.compat.enable_torch_proxy always",
        ),
        cherry_picks=("d12aa284a77b505ef98f9bd0f9b984ada1ecb8fc",),
    ),
)
"""What changed for the hook after 8c3513a4, oldest first; ``hpu-fp8 doctor`` says which of them a FastDeploy
checkout carries (git ancestry)."""

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
    Release("2.5", True, "release/2.5, cut from develop 335ab70b (2026-02-10): carries PR 5324, PR 5855 and PR 5880 (git)"),
    Release("2.6", True, "release/2.6, cut from develop e3aed6de (2026-04-03): carries PR 5324, PR 5855 and PR 5880 (git)"),
)


@dataclass(frozen=True)
class PaddleCall:
    """A paddle attribute FastDeploy calls, where it calls it, and the oldest paddle that has it."""

    attribute: str  # dotted, from ``paddle``
    fastdeploy_file: str  # relative to the fastdeploy package
    since: str  # the develop commit (short) from which FastDeploy calls it
    paddle_minimum: str
    without_torch_only: bool = False  # FastDeploy makes the call only where no torch distribution is installed


PADDLE_CALLS: tuple[PaddleCall, ...] = (
    PaddleCall("paddle.compat.enable_torch_proxy", "__init__.py", "131defa1", "3.3.0"),
    # from 8b6bbb35 on develop (release/2.5: its cherry-pick d12aa284): `if not _is_package_installed("torch")`
    PaddleCall("paddle.enable_compat", "__init__.py", "8b6bbb35", "3.3.0", without_torch_only=True),
)
"""What FastDeploy's import calls of paddle that older paddles lack (paddle 3.3.0 is the first wheel with either:
3.1.1's has no paddle.compat, 3.2.2's neither name); doctor checks each one the sources call."""

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


def build_for_version(version: str) -> FastDeployBuild | None:
    """The checked release build whose line a reported version (``2.5.0``, ``2.6.1``) names; None for a -dev build
    (the commit decides) or a line no checked build heads."""
    if "dev" in version or _release_line(version) is None:
        return None
    return next((b for b in BUILDS if b.name.startswith("release/") and _release_line(b.version) == _release_line(version)), None)


def render_versions() -> str:
    """Which FastDeploy and which paddle, as a reader of the README and docs/fastdeploy.md needs it: rendered from
    the constants above (scripts/render_readme.py), so that the documents and ``hpu-fp8 doctor`` agree."""
    take = RECOMMENDED_BUILD
    others = ", ".join(f"`{b.name}` `{b.commit.short}` ({b.version})" for b in BUILDS if b is not take)
    calls = " or ".join(f"`{c.attribute}`" for c in PADDLE_CALLS)
    return (
        f"- **FastDeploy**: take `{take.name}` (`{take.commit.short}`, version {take.version}; "
        f"`git checkout {take.commit.commit}`), checked against FastDeploy's own loading on a CPU, not yet on a Gaudi. "
        f"Also checked: {others}. Any `{SUPPORTED_BRANCH}` commit from `{FIRST_SUPPORTED_COMMIT.short}` "
        f"({FIRST_SUPPORTED_COMMIT.date}, {PR_5324}) should serve [inferred]; 2.3 and 2.4 lack it. Why this one and "
        "what changed between them: [docs/fastdeploy.md section 1](docs/fastdeploy.md#1-scope-commits-covered-and-"
        "compatibility-matrix). `hpu-fp8 doctor` names the FastDeploy it finds.\n"
        f"- **paddle**: {PADDLE_MINIMUM} or newer. FastDeploy's `__init__.py` calls {calls} (the latter, from "
        f"`{PADDLE_CALLS[-1].since}`, only where torch is not installed), which paddle 3.1.1, the version FastDeploy's "
        f"Gaudi guide installs, lacks: install paddlepaddle>={PADDLE_MINIMUM} and a PaddleCustomDevice `intel_hpu` "
        "wheel built against it [not yet seen on a Gaudi]. `hpu-fp8 doctor` checks that paddle has what FastDeploy calls.\n"
    )


def render_builds() -> str:
    """The builds the suite checks and the changes between them, as docs/fastdeploy.md section 1 holds them."""
    rows = [
        "| build | commit | version.txt | MoE layout | Qwen3 q/k norms | Qwen3-MoE gate | checked |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in BUILDS:
        mark = " (take this one)" if b is RECOMMENDED_BUILD else ""
        mark += " (CI)" if b is CI_BUILD else ""
        rows.append(
            f"| `{b.name}`{mark} | `{b.commit.short}` ({b.commit.date}) | `{b.version}` | {b.moe_layout} | {b.qwen3} | "
            f"{b.moe_gate} | {b.commit.why} |"
        )
    rows += ["", "| change (develop) | date | on release branches | what it changes for the hook |", "|---|---|---|---|"]
    for change in CHANGES:
        c = change.commit
        picks = ", ".join(f"cherry-pick `{p[:8]}`" for p in change.cherry_picks)
        rows.append(f"| `{c.short}` {c.title} | {c.date} | {picks or 'by ancestry'} | {c.why} |")
    return "\n".join(rows) + "\n"
