"""Publish an hpu-fp8 checkpoint: convert, validate, evaluate, write the card, upload, verify.

Everything that can be refused is refused before the heavy work: repo ids (huggingface_hub's own
rules) and HF_ENDPOINT, the revision (git's ref-name rules), the commit message, the work directory
(never overlapping an input, never replacing a directory this tool did not stage), the measurement
files, the source card's license, and (unless ``dry_run``) the token and its write access to the
repository. A checkpoint that fails validation is never uploaded. The measurement file(s) used are
uploaded beside the checkpoint (``hpu_fp8_measurements.json``) and cited by the card. After the upload
the remote file list of the commit (or the pull request's revision) is compared with the local
manifest: every size, and the identifier the Hub gives each file (the LFS sha256 of large files, the
git blob id of small ones). The token comes from huggingface_hub's usual sources (``HF_TOKEN``,
``hf auth login``) and is never printed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.console import Progress, hub_bars_follow_ours, human_count
from hpu_fp8_loader.conversion.convert import convert, convert_steps
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.engine.layer_major import layer_steps
from hpu_fp8_loader.errors import HpuFp8Error, OutputExistsError, UnsafePathError, UploadError, WriteFailedError, one_line
from hpu_fp8_loader.hub.cards import CardFile, CardPlot, check_license, render_card
from hpu_fp8_loader.io.checkpoint import read_config, source_file
from hpu_fp8_loader.io.manifest import MANIFEST_FILE, foreign_entry, write_manifest
from hpu_fp8_loader.io.own_files import read_own, write_new
from hpu_fp8_loader.io.writer import check_apart
from hpu_fp8_loader.quality import DEFAULT_EVAL_SAMPLES, DEFAULT_EVAL_SEQ_LEN
from hpu_fp8_loader.quality.calibrate import one_source_of_statistics
from hpu_fp8_loader.quality.evaluate import EvaluationResult, evaluate
from hpu_fp8_loader.quality.quantize import quantize
from hpu_fp8_loader.quality.report import REPORT_FILE, Report
from hpu_fp8_loader.sources.hub_replies import guard_hub_client
from hpu_fp8_loader.sources.measurements import load_measurement_sets
from hpu_fp8_loader.sources.resolve import (
    SOURCE_PATTERNS,
    check_repo_id,
    check_revision,
    hub_error,
    hub_failures,
    resolve_checkpoint,
)
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec.measurements import MEASUREMENTS_FILE, Measurements, measurement_file_names

__all__ = [
    "MEASUREMENTS_FILE",
    "REPORT_PLOT_PREFIX",
    "PushOptions",
    "PushResult",
    "commit_message",
    "git_blob_id",
    "push",
    "remote_problems",
]

log = logging.getLogger(__name__)

CARD = "README.md"
STAGED = "checkpoint"
# The report plots uploaded beside the checkpoint and shown in the card: report-eval-linear_error.png, ... (flat
# names at the top of the repository, which `pull` downloads and checks against the manifest like every file).
REPORT_PLOT_PREFIX = "report-"
# Written into a work directory before anything is staged there: only then may a later push replace WORK/checkpoint.
STAGING_MARKER = ".hpu-fp8-push"
# What the marker holds: only a regular file with exactly this (never a link, whatever it points to) is ours.
_MARKER_TEXT = b"hpu-fp8 push stages its checkpoint here; a later push may replace it\n"
# Above this many parameters the CPU evaluation takes long enough to ask for it explicitly.
EVAL_PARAMETER_LIMIT = 3e9
# A rough CPU throughput of the float32 engine, for the time estimate printed instead.
_ENGINE_FLOPS = 5e10
# The front matter opens a card: only this much of the source's README.md is read for the license.
_CARD_HEAD_BYTES = 1 << 20
# A longer license value is no identifier (cards.check_license allows 64 characters) and is not quoted back.
_LICENSE_SHOWN = 64


@dataclass
class PushOptions:
    repo_id: str
    measurements: Sequence[Path] = ()
    calibrate: bool = False
    license: str | None = None
    base_model: str | None = None
    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    commit_message: str | None = None
    work_dir: Path | None = None
    dry_run: bool = False
    evaluation: str = "auto"  # auto | always | skip
    convert: ConvertOptions = field(default_factory=ConvertOptions)
    # progress of calibrate, convert and eval on stderr: a bar on a terminal, lines in a log (console.Progress)
    show_progress: bool = False


@dataclass
class PushResult:
    """What a push did. ``checkpoint``: the staged checkpoint under ``--work-dir``, or None when it was staged in a
    temporary directory, removed before :func:`push` returned. ``files``: every file of the commit, the manifest
    (which does not list itself) included."""

    checkpoint: Path | None
    files: list[CardFile]
    evaluation: EvaluationResult | None
    commit_url: str | None = None
    pull_request_url: str | None = None


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub) gives a small file: sha1 of ``blob <size>\\0`` + content."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def _card_problem(source: Path, why: str) -> HpuFp8Error:
    """The source's card cannot give the base model's license: name it, and the option that makes it unneeded."""
    return HpuFp8Error(f"{source / CARD}: {why}; pass --license with the base model's license")


def _front_matter(source: Path) -> dict | None:
    """The YAML front matter of the source's README.md as huggingface_hub finds it, or None without one.

    Only a regular file inside the source is read (a Hub snapshot's link into its blob store counts), and
    only its first MiB: the front matter opens a card, and a card can be huge. Text that is not UTF-8 or
    not YAML, or YAML that is not a mapping, is refused by name rather than read as "no license".
    """
    import yaml
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    try:
        path = source_file(source, CARD)
    except UnsafePathError:
        raise _card_problem(source, "not a regular file inside the source (a directory, or a link out of it)") from None
    if path is None:
        return None
    with path.open("rb") as file:
        head = file.read(_CARD_HEAD_BYTES)
    if len(head) == _CARD_HEAD_BYTES:
        head = head[: head.rfind(b"\n") + 1]  # a whole number of lines, so no character is cut in two
    try:
        match = REGEX_YAML_BLOCK.search(head.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise _card_problem(source, f"not UTF-8 text (byte {exc.start} is 0x{head[exc.start]:02x})") from None
    if match is None:
        return None
    try:
        data = yaml.safe_load(match.group(2))
    except (yaml.YAMLError, RecursionError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 2})" if mark is not None else ""
        raise _card_problem(source, f"its front matter is not valid YAML{where}") from None
    if data is not None and not isinstance(data, dict):
        raise _card_problem(source, "its front matter is not a mapping of keys to values")
    return data


def _license_of(source: Path) -> str | None:
    """The base model's license from the source's README.md front matter, or None when it names none.

    The Hub's metadata takes one license (``ModelCardData.license`` is a string): a list of one is that
    license, a list of several is refused, since which applies to the quantized model is the publisher's
    call. Anything else that is not a license identifier is refused too; it would reach the published card.
    """
    value = (_front_matter(source) or {}).get("license")
    if isinstance(value, list) and len(value) <= 1:
        value = value[0] if value else None
    if value is None or value == "":
        return None
    if isinstance(value, list):
        raise _card_problem(source, f"its front matter names {len(value)} licenses and a card takes one")
    if isinstance(value, str) and len(value) <= _LICENSE_SHOWN:
        try:
            return check_license(value)
        except HpuFp8Error:
            raise _card_problem(source, f"its license {value!r} is not a Hub license identifier like apache-2.0") from None
    raise _card_problem(source, "its license is not a Hub license identifier like apache-2.0")


def _exists(text: str) -> bool:
    """Whether ``text`` names an existing file; a name the OS cannot look up (too long, a NUL) names none."""
    try:
        return Path(text).exists()
    except (OSError, ValueError):
        return False


def _public_name(text: str) -> str:
    """``text`` as it may appear in public: a local path (a dataset or measurement file) becomes its base name."""
    local = os.path.isabs(text) or text.startswith(("~", ".")) or "\\" in text or _exists(text)
    return PurePath(text.replace("\\", "/")).name if local else text


def _publishable(measurements: Measurements) -> Measurements:
    """The same statistics with local paths in their provenance reduced to base names (they reach config.json,
    the uploaded measurement file and the card)."""
    provenance = measurements.provenance
    public = provenance.model_copy(
        update={
            "dataset": _public_name(provenance.dataset) if provenance.dataset else provenance.dataset,
            "files": [_public_name(f) for f in provenance.files],
        }
    )
    return measurements.model_copy(update={"provenance": public})


def _object(value: object) -> dict:
    """``value`` if it is a JSON object, else an empty one: whoami's fields are the Hub's to fill, and a field that is
    missing or of another shape says nothing (the Hub refuses the upload itself if the token cannot write)."""
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    """``value`` if it is a JSON list, else an empty one (see :func:`_object`)."""
    return value if isinstance(value, list) else []


def _name(value: object) -> str:
    """A name from the Hub's answer as a message may show it: one line, never a forged second one."""
    return one_line(value) if isinstance(value, str) else "?"


def _write_problem(me: dict, repo_id: str) -> str | None:
    """Why the account ``whoami`` describes cannot write to ``repo_id``, or None when nothing says it cannot."""
    namespace = repo_id.split("/")[0]
    token = _object(_object(me.get("auth")).get("accessToken"))
    if token.get("role") == "read":
        return "the token is read-only; use a token with write access"
    if token.get("role") == "fineGrained":
        scoped = _object(token.get("fineGrained")).get("scoped")
        if not any(
            _object(entry.get("entity")).get("name") in (namespace, repo_id) and "repo.write" in _list(entry.get("permissions"))
            for entry in map(_object, _list(scoped))
        ):
            return f"the fine-grained token has no repo.write permission for {namespace}"
    if me.get("type") != "user" or namespace == me.get("name"):
        return None
    org = next((o for o in map(_object, _list(me.get("orgs"))) if o.get("name") == namespace), None)
    if org is None:
        return f"{namespace} is neither the token's account ({_name(me.get('name'))}) nor one of its organisations"
    if org.get("roleInOrg") == "read":
        return f"{_name(me.get('name'))} may only read in the organisation {namespace}"
    return None


def check_write_access(api, repo_id: str) -> None:
    """Refuse at once, before any heavy work, a missing or invalid token, a read-only one, or a namespace the
    account cannot write to (``whoami``): otherwise these surface only after the conversion."""
    from huggingface_hub.errors import LocalTokenNotFoundError

    try:
        me = api.whoami()
    except LocalTokenNotFoundError:
        raise UploadError(f"{repo_id}: not logged in to the Hub; log in with `hf auth login` or set HF_TOKEN") from None
    except hub_failures() as exc:
        raise hub_error(repo_id, exc, "checking the token", UploadError) from None
    problem = _write_problem(me, repo_id)
    if problem:
        raise UploadError(f"{repo_id}: cannot publish: {problem}")


def _staging_dir(work: Path, inputs: Sequence[Path]) -> Path:
    """``WORK/checkpoint``, checked before anything is written: it never overlaps an input (the source, a
    measurement file), and an existing one is replaced only when a push staged it (``WORK/.hpu-fp8-push``) and its
    manifest still accounts for everything in it (``io.manifest.foreign_entry``); anything else found there is
    refused, never deleted."""
    checkpoint = work / STAGED
    try:
        check_apart(checkpoint, inputs)
    except UnsafePathError as exc:
        raise UnsafePathError(f"--work-dir {work}: {exc}") from None
    if checkpoint.is_symlink() or (checkpoint.exists() and not checkpoint.is_dir()):
        raise UnsafePathError(
            f"{checkpoint}: a link or a file, not a directory hpu-fp8 push staged; remove it or choose another --work-dir"
        )
    ours = read_own(work / STAGING_MARKER, len(_MARKER_TEXT)) == _MARKER_TEXT  # a link or another file: not ours
    if checkpoint.exists() and not ours:
        raise OutputExistsError(
            f"{checkpoint}: already exists and was not staged by hpu-fp8 push; remove it or choose another --work-dir"
        )
    if checkpoint.exists() and any(checkpoint.iterdir()) and (reason := foreign_entry(checkpoint)) is not None:
        raise OutputExistsError(
            f"{checkpoint}: {reason}, so it is not a checkpoint as hpu-fp8 push staged it; nothing was removed: "
            "remove it yourself or choose another --work-dir"
        )
    return checkpoint


def _check_commit_message(text: str) -> None:
    """A commit message is shown as written (git log, the Hub's pages): lines of printable text, tabs allowed.
    A carriage return, an escape sequence or a NUL would let it rewrite what a terminal or a page shows."""
    if not text.strip():
        raise HpuFp8Error("--commit-message is blank: leave it out for the default message")
    bad = next((i for i, c in enumerate(text) if not (c.isprintable() or c in "\n\t")), None)
    if bad is not None:
        raise HpuFp8Error(
            f"--commit-message holds the control character {text[bad]!r} at position {bad}; only newlines and tabs may"
        )


def _checked_options(options: PushOptions) -> list[Measurements]:
    """Options that contradict each other, or that git or the Hub would refuse only after the conversion, are
    refused; the measurement files are read (and so checked) before any heavy work, and returned ([] with
    ``--calibrate``)."""
    if options.revision is not None:
        check_revision(options.revision)
    if options.commit_message is not None:
        _check_commit_message(options.commit_message)
    if options.create_pr and options.revision:
        raise HpuFp8Error("--create-pr and --revision both given: a pull request is opened against the default branch")
    one_source_of_statistics(bool(options.measurements), options.calibrate)
    return [_publishable(s.measurements) for p in options.measurements for s in load_measurement_sets(p)]


def _add_files(checkpoint: Path, files: dict[str, bytes]) -> list[CardFile]:
    """Write ``files`` into the checkpoint, then the manifest again so that it lists them too."""
    known = {
        name: (entry["size"], entry["sha256"])
        for name, entry in json.loads((checkpoint / MANIFEST_FILE).read_text())["files"].items()
        if name not in files
    }
    for name, data in files.items():
        write_new(checkpoint / name, data)  # never through a link someone put there since convert published it
    manifest = write_manifest(checkpoint, known)
    return [CardFile(name, entry["size"], entry["sha256"]) for name, entry in sorted(manifest["files"].items())]


def _stage(
    src: Path, measurements: list[Measurements], options: PushOptions, checkpoint: Path, say: Callable[[str], None]
) -> tuple[EvaluationResult | None, str | None, list[str], list[CardPlot]]:
    """Convert into ``checkpoint`` (replacing an earlier push's; with ``--calibrate``, calibrate and convert in one
    step), validate, name the measurement files convert kept in it (returned), evaluate, add the plots of the
    calibration and evaluation reports (returned for the card)."""
    reports: dict[str, Report] = {}
    if checkpoint.exists():  # _staging_dir made sure that an earlier push staged it
        shutil.rmtree(checkpoint)
    quiet = not options.show_progress
    with (
        Progress("calibrate", quiet=quiet or not options.calibrate, unit="step") as steps,
        Progress("convert", quiet=quiet) as bytes_,
    ):
        if options.calibrate:
            say("calibrating with the reference engine on the built-in text ...")
            reports["calibrate"] = Report()
            quantized = quantize(
                src, checkpoint, None, options.convert, convert_steps(bytes_), layer_steps(steps), reports["calibrate"]
            )
            measurements = [quantized.measurements]
            for warning in quantized.calibration.warnings if quantized.calibration else ():
                log.warning(warning)
            if quantized.calibration is None:  # an interrupted push's calibration, reused: no report of its forwards
                del reports["calibrate"]
        else:  # convert keeps the measurement files in the checkpoint, which uploads them
            convert(src, checkpoint, measurements, options.convert, convert_steps(bytes_))
    report = validate(checkpoint)
    if not report.valid:
        listing = "; ".join(f"[{v.rule}] {v.where}: {v.message}" for v in report.violations[:5])
        raise HpuFp8Error(f"the converted checkpoint is not valid, so nothing is uploaded: {listing}")
    names = measurement_file_names(len(measurements))
    say(f"converted and validated: {checkpoint if options.work_dir else 'in a temporary directory'}")
    from hpu_fp8_loader.arch import describe

    parameters = describe(read_config(src)).parameter_count()
    evaluation, note = None, None
    if options.evaluation == "skip":
        note = "skipped with --skip-eval"
    elif parameters > EVAL_PARAMETER_LIMIT and options.evaluation != "always":
        minutes = 2 * parameters * DEFAULT_EVAL_SAMPLES * DEFAULT_EVAL_SEQ_LEN * 2 / _ENGINE_FLOPS / 60
        note = f"{human_count(parameters)} parameters: about {minutes:.0f} CPU minutes; pass --eval to run it"
        say(f"no evaluation: {note}")
    else:
        reports["eval"] = Report()
        with Progress("eval", quiet=quiet, unit="step") as steps:  # eval's default text, as `hpu-fp8 eval`
            evaluation = evaluate(src, checkpoint, report=reports["eval"], progress=layer_steps(steps))
        say(f"evaluated: FP8 top-1 agreement {100 * evaluation.rows[0].top1_agreement:.2f}%")
        for warning in evaluation.warnings:  # before anything is uploaded: the user can still stop here
            log.warning(warning)
    plots = _add_report_plots(checkpoint, reports)
    return evaluation, note, names, plots


def _add_report_plots(checkpoint: Path, reports: dict[str, Report]) -> list[CardPlot]:
    """Each report's PNGs into the checkpoint as ``report-<kind>-<plot>.png`` (report.json and index.html stay
    behind: they name local paths), a plot identical to one already added once; and what the card shows of them."""
    from hpu_fp8_loader.quality.report_plots import CAPTIONS

    plots: list[CardPlot] = []
    files: dict[str, bytes] = {}
    for kind, report in reports.items():
        with tempfile.TemporaryDirectory(prefix="hpu-fp8-report-") as where:
            written = report.write(Path(where) / kind)
            for plot, file in json.loads((written / REPORT_FILE).read_text())["plots"].items():
                data = (written / file).read_bytes()
                if data in files.values():  # eval's weight spread (and amax, when served as calibrated) repeat calibrate's
                    continue
                name = f"{REPORT_PLOT_PREFIX}{kind}-{file}"
                files[name] = data
                plots.append(CardPlot(name, kind, CAPTIONS[plot]))
    if files:
        _add_files(checkpoint, files)
    return plots


def reproduce_command(options: PushOptions, base_model: str, measurement_files: Sequence[str]) -> str:
    """The card's reproduce line: repo ids and the uploaded files' names only, never a local path. The statistics are
    the uploaded measurement files, a calibration's too, so that the line makes the same checkpoint again."""
    statistics = [arg for name in measurement_files for arg in ("--measurements", name)] or ["--calibrate"]
    settings = options.convert
    return shlex.join(
        [
            *("hpu-fp8", "push", base_model, "--repo-id", options.repo_id, *statistics),
            *("--target", settings.target.value, "--kv-cache", settings.kv_cache.value),
            *("--dead-experts", settings.dead_experts.value),
            *(("--license", options.license) if options.license else ()),
        ]
    )


def _write_card(
    checkpoint: Path,
    license_: str,
    base_model: str,
    options: PushOptions,
    evaluation: EvaluationResult | None,
    note: str | None,
    measurement_files: Sequence[str],
    plots: Sequence[CardPlot] = (),
) -> list[CardFile]:
    """README.md from model_cards/, then the manifest again so that it lists the card too."""
    command = reproduce_command(options, base_model, measurement_files)
    card = render_card(checkpoint, options.repo_id, base_model, license_, command, evaluation, note, measurement_files, plots)
    return _add_files(checkpoint, {CARD: card.encode("utf-8")})


def commit_message(options: PushOptions, files: int) -> str:
    """The commit's message: the one asked for, else one counting the files; what a dry run shows is what is used."""
    return options.commit_message or f"Upload hpu-fp8 checkpoint ({files} files)"


def remote_problems(api, repo_id: str, revision: str, checkpoint: Path) -> list[str]:
    """Every file whose remote size or identifier differs from the local manifest, and every one missing."""
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    remote = {f.path: f for f in api.list_repo_tree(repo_id, revision=revision, recursive=True) if hasattr(f, "size")}
    own = (checkpoint / MANIFEST_FILE).read_bytes()  # the manifest does not list itself: its figures come from the file
    expected = {**manifest, MANIFEST_FILE: {"size": len(own), "sha256": hashlib.sha256(own).hexdigest()}}
    problems = []
    for name, entry in sorted(expected.items()):
        found = remote.get(name)
        if found is None:
            problems.append(f"{name}: missing on the Hub")
        elif found.size != entry["size"]:
            problems.append(f"{name}: {found.size} bytes on the Hub, {entry['size']} here")
        elif found.lfs is not None:
            if found.lfs.sha256 != entry["sha256"]:
                problems.append(f"{name}: LFS sha256 on the Hub differs from the local file")
        elif found.blob_id != git_blob_id(own if name == MANIFEST_FILE else (checkpoint / name).read_bytes()):
            problems.append(f"{name}: git blob id on the Hub differs from the local file")
    return problems


def _upload(api, checkpoint: Path, options: PushOptions, say: Callable[[str], None]) -> tuple[str, str | None]:
    """Commit the checkpoint (or open a pull request), then verify the revision the Hub says holds it."""
    hub_bars_follow_ours()
    try:
        api.create_repo(options.repo_id, private=options.private, exist_ok=True)
        if options.revision:
            api.create_branch(options.repo_id, branch=options.revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=options.repo_id,
            folder_path=checkpoint,
            revision=options.revision,
            commit_message=commit_message(options, len(list(checkpoint.iterdir()))),
            create_pr=options.create_pr,
        )
        if options.create_pr and commit.pr_revision is None:
            raise UploadError(f"{options.repo_id}: a pull request was asked for, but the Hub committed {commit.oid} without one")
        say(f"uploaded: {commit.pr_url or commit.commit_url}")
        problems = remote_problems(api, options.repo_id, commit.pr_revision or commit.oid, checkpoint)
    except hub_failures() as exc:
        raise hub_error(options.repo_id, exc, "uploading", UploadError) from None
    if problems:
        raise UploadError(f"{options.repo_id}: the uploaded files differ from the local checkpoint: " + "; ".join(problems[:10]))
    return commit.commit_url, commit.pr_url


def push(src: str | Path, options: PushOptions, say: Callable[[str], None] = print) -> PushResult:
    """Convert ``src``, check it, describe it and (unless ``dry_run``) upload and verify it.

    The cheap checks come first, in this order: repo ids, options and measurement files, the token's
    write access (not for a dry run), the source, the license, the work directory.
    """
    source_id = str(src)
    check_repo_id(options.repo_id, "--repo-id")  # first: it checks HF_ENDPOINT before huggingface_hub is imported
    local = Path(source_id).exists() or source_id in TINY_MODELS
    base_model = options.base_model or (source_id if not local else None)  # a Hub id is the base
    if not base_model:
        raise HpuFp8Error("the base model's Hub id is unknown: pass --base-model ORG/NAME")
    check_repo_id(base_model, "--base-model" if options.base_model else "SRC", namespace=False)
    if options.license is not None:  # an empty one too: it must not fall back to the source card's silently
        check_license(options.license)
    measurements = _checked_options(options)
    from huggingface_hub import HfApi

    api = HfApi()
    guard_hub_client()  # replies of a shape the client cannot read, or that name cache paths, are refused as they come
    if not options.dry_run:
        check_write_access(api, options.repo_id)
    src = resolve_checkpoint(src, allow_patterns=[*SOURCE_PATTERNS, CARD])  # the card, for the base model's license
    license_ = options.license or _license_of(src)
    if not license_:
        raise HpuFp8Error("no license known for the base model (none in the source's README.md front matter): pass --license")
    staging = tempfile.TemporaryDirectory(prefix="hpu-fp8-push-") if options.work_dir is None else nullcontext(options.work_dir)
    with staging as where:
        work = Path(where)
        checkpoint = _staging_dir(work, [src, *options.measurements])
        work.mkdir(parents=True, exist_ok=True)
        try:
            write_new(work / STAGING_MARKER, _MARKER_TEXT)  # a link planted at that name is replaced, not written through
        except OSError as exc:
            raise WriteFailedError(f"{work / STAGING_MARKER}: cannot be written: {exc.strerror or exc}") from None
        evaluation, note, names, plots = _stage(src, measurements, options, checkpoint, say)
        files = _write_card(checkpoint, license_, base_model, options, evaluation, note, names, plots)
        manifest = (checkpoint / MANIFEST_FILE).read_bytes()  # uploaded too, though it does not list itself
        files.append(CardFile(MANIFEST_FILE, len(manifest), hashlib.sha256(manifest).hexdigest()))
        result = PushResult(checkpoint if options.work_dir else None, files, evaluation)
        if not options.dry_run:
            result.commit_url, result.pull_request_url = _upload(api, checkpoint, options, say)
    return result
