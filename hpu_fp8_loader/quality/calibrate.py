"""Activation statistics from the reference engine: what FastDeploy's measurement mode records,
without an HPU (docs/fastdeploy.md section 10, "Measurement mode"), plus the Qwen2 MLP points FastDeploy
forgets (same section: ``convert_model`` never sets measurement mode on ``Qwen2MLP``).

Each point's value is the whole-tensor max |x| over every batch; each expert's intermediate is taken
over the tokens routed to it, as FastDeploy does. ``all_experts`` also runs every token through every
expert for the statistics only (never for the forward): no expert stays uncalibrated, at the price
of wider expert ranges and about E/k times the expert work.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpu_fp8_loader import __version__
from hpu_fp8_loader.engine.layer_major import LayerProgress, run_layer_major
from hpu_fp8_loader.engine.model import EngineConfig, Observer, ReferenceModel
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.errors import MeasurementError, NonFiniteError
from hpu_fp8_loader.io.file_output import check_output_file, write_text_atomically
from hpu_fp8_loader.quality.datasets import BUILTIN, check_seq_len, dataset_tokens, token_windows
from hpu_fp8_loader.quality.observers import AmaxObserver, ChannelAmaxObserver, RangeObserver, TeeObserver
from hpu_fp8_loader.quality.ranges import PointRange, point_ranges, range_warning
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import AmaxSourceKind
from hpu_fp8_loader.spec.measurements import MeasurementProvenance, Measurements, ModelIdentity

if TYPE_CHECKING:
    from hpu_fp8_loader.quality.report import Report

__all__ = [
    "CalibrationOptions",
    "CalibrationResult",
    "calibrate",
    "check_outputs",
    "one_source_of_statistics",
    "write_fastdeploy_file",
]

log = logging.getLogger(__name__)


@dataclass
class CalibrationResult:
    """What :func:`calibrate` measured, and how.

    Attributes:
        measurements: every activation amax of the model, with provenance ``reference-engine`` and the number of
            tokens each expert saw; what :func:`~hpu_fp8_loader.convert` reads and
            :func:`~hpu_fp8_loader.write_measurements` writes.
        tokenizer: which tokenizer made the tokens: ``"tokenizer.json"`` or ``"tokenizer.model (sentencepiece)"``
            (the model's own), or ``"bytes"`` (one token per UTF-8 byte: asked for, or a byte-level model without a
            tokenizer file); also the measurements' ``provenance.tokenizer``.
        tokens: tokens run through the model.
        seconds: wall time of the calibration.
        dead_experts: ``(layer, expert)`` of every routed expert no calibration token reached, sorted; convert
            refuses them unless its ``dead_experts`` option is ``sibling-max`` (or calibrate again with
            ``all_experts``).
        ranges: every point's amax against the median and 99th percentile of its |x| on the calibration text, the
            widest first (:mod:`~hpu_fp8_loader.quality.ranges`).
        warnings: such as points whose amax / median exceeds what E4M3 at ±240 holds, named.
        channel_amax: each of the ``channel_points`` asked for, its max |x| per channel (what a channel fold's
            exponents are chosen from: :mod:`~hpu_fp8_loader.conversion.folds`); empty when none was asked for.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, calibrate
        >>> result = calibrate(TINY_MODELS["qwen2-bytes"], samples=8, seq_len=64)
        >>> result.tokenizer, result.tokens, result.dead_experts
        ('bytes', 512, [])
    """

    measurements: Measurements
    tokenizer: str
    tokens: int
    seconds: float
    dead_experts: list[tuple[int, int]] = field(default_factory=list)  # (layer, expert) without a routed token
    ranges: list[PointRange] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    channel_amax: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class CalibrationOptions:
    """How :func:`calibrate` runs, as one value: what ``hpu-fp8 calibrate``, ``convert --calibrate`` and
    ``import --calibrate`` take from the same options, and what :func:`~hpu_fp8_loader.quantize` records to resume.

    Attributes:
        dataset: ``"builtin"`` (Python's own documentation, its last 10% held out for eval), a ``.txt``,
            ``.jsonl`` or ``.parquet`` file, a directory of them, or a Hub dataset repo id ``ORG/NAME``.
        samples: windows of ``seq_len`` tokens to run.
        seq_len: tokens per window (at most the model's max_position_embeddings).
        batch_size: windows run through a layer at a time (memory, not the result).
        all_experts: also run every token through every routed expert, for the statistics only.
        tokenizer: ``"auto"`` (the model's own) or ``"bytes"``.
        text_field: the JSONL key or parquet column of each record's text.
        chat_template: render each record's ``messages`` through the model's chat template instead.
        dataset_revision: the branch, tag or commit of a Hub ``dataset``.
        threads: windows run at once on threads of their own (default: every core this process may use); the amax
            are those of one thread with BLAS on as many threads (see :func:`calibrate`).

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, CalibrationOptions
        >>> options = CalibrationOptions(samples=8, seq_len=64)
        >>> options.run(TINY_MODELS["qwen2-bytes"]).tokens
        512
    """

    dataset: str = BUILTIN
    samples: int = 32
    seq_len: int = 256
    batch_size: int = 4
    all_experts: bool = False
    tokenizer: str = "auto"
    text_field: str = "text"
    chat_template: bool = False
    dataset_revision: str | None = None
    threads: int | None = None

    def run(
        self,
        model: str | Path,
        progress: Callable[[LayerProgress], object] | None = None,
        scratch_dir: str | Path | None = None,
        report: Report | None = None,
        channel_points: frozenset[str] = frozenset(),
    ) -> CalibrationResult:
        """:func:`calibrate` ``model`` with these options (the other arguments as :func:`calibrate` takes them)."""
        fields = dataclasses.asdict(self)
        return calibrate(
            model, progress=progress, scratch_dir=scratch_dir, report=report, channel_points=channel_points, **fields
        )


def one_source_of_statistics(measurements: bool, calibration: bool, required: bool = True) -> None:
    """Refuse both of the two sources of activation statistics (measurement files, a calibration), and neither when
    one is ``required`` (import reads a static checkpoint's own input scales without either).

    Raises:
        MeasurementError: both given, or neither when one is required.
    """
    if measurements and calibration:
        raise MeasurementError("--measurements and --calibrate both given: pass one source of activation statistics")
    if required and not (measurements or calibration):
        raise MeasurementError("no activation statistics: pass --measurements FILE or --calibrate")


def calibrate(
    model: str | Path,
    dataset: str | Path = BUILTIN,
    samples: int = 32,
    seq_len: int = 256,
    batch_size: int = 4,
    all_experts: bool = False,
    progress: Callable[[LayerProgress], object] | None = None,
    scratch_dir: str | Path | None = None,
    *,
    tokenizer: str = "auto",
    text_field: str = "text",
    chat_template: bool = False,
    dataset_revision: str | None = None,
    report: Report | None = None,
    threads: int | None = None,
    channel_points: frozenset[str] = frozenset(),
) -> CalibrationResult:
    """Run the reference engine over ``samples`` windows of ``dataset`` and record every act amax.

    Layer-major: all windows go through layer L before layer L+1 is read, so each layer's weights are read and
    converted once, whatever the number of windows; no logits are computed. Within a layer the weights are read in
    parts, each once for all windows: attention, then the dense MLP, or the router and each routed expert in turn
    (:mod:`~hpu_fp8_loader.engine.weights`). Memory: the largest such part in float32 (a dense MLP, or the
    attention; in an MoE layer the router part and one expert, whatever the expert count), a second one while the
    next is read ahead (when two fit half the memory budget), ``batch_size`` windows' activations, and three stores
    of all windows' hidden states (``3 x samples x seq_len x hidden x 4`` bytes) when they fit a quarter of the
    memory budget, else in scratch files in ``scratch_dir``. The amax are those of running the windows batch by
    batch, to the bit.

    Activation statistics without an HPU: the float32 reference engine records, at every point FastDeploy's
    measurement mode records (plus the Qwen2 MLP points it forgets), the whole-tensor max |x| over every window;
    each expert's intermediate over the tokens routed to it. Tokens come from the model's own tokenizer
    (tokenizer.json, else the sentencepiece tokenizer.model, with tokenizer_config.json's BOS), one document at a
    time; byte tokens only when asked for or for a byte-level model (no tokenizer file, a vocabulary of at most 512).

    Args:
        model: a local checkpoint directory: a BF16 source (either layout) or an hpu-fp8 checkpoint.
        dataset: ``"builtin"`` (the first 90% of Python's own documentation; the rest is held out for
            :func:`~hpu_fp8_loader.evaluate`), a UTF-8 ``.txt`` file, a ``.jsonl`` file of ``{"text": ...}`` lines, a
            ``.json`` array of such records, a ``.csv`` or ``.parquet`` file with a ``text`` column, a directory of
            such files, or a Hub dataset repo id ``ORG/NAME`` (from the Hugging Face cache; a local path that exists
            wins; the snapshot's commit goes into the measurements' ``provenance.dataset_revision``). Read only
            until ``samples * seq_len`` tokens are made.
        samples: how many windows to run (fewer when the text holds fewer).
        seq_len: tokens per window; at most the model's ``max_position_embeddings``.
        batch_size: windows per forward.
        all_experts: also run every token through every routed expert, for the statistics only (never for the
            forward): no expert stays uncalibrated, at the price of wider expert ranges and about E/k times the
            expert work.
        progress: called after each step (``batch_size`` windows through one stage of a layer: its attention, its MLP,
            its router, one expert) with a
            :class:`~hpu_fp8_loader.engine.layer_major.LayerProgress`: steps done, their total, the layer.
        scratch_dir: where the hidden states of all windows wait between layers when they do not fit a quarter of
            the memory budget (a scratch file, unlinked as soon as it is mapped); default: the system temp directory.
            ``hpu-fp8 calibrate`` uses the ``-o`` file's directory.
        tokenizer: ``"auto"`` (the model's own; refused when it has none, unless a byte-level model) or ``"bytes"``.
        text_field: the JSON key, CSV column or parquet column holding each record's text.
        chat_template: render each record's ``messages`` through the model's chat template instead.
        dataset_revision: the branch, tag or commit of a Hub ``dataset``.
        report: a :class:`~hpu_fp8_loader.Report` that collects, during the same forwards, each linear's FP8
            output error, the weight spread and the expert load; write it afterwards with ``report.write(DIR)``.
        threads: chunks of ``batch_size`` windows run at once on threads of their own, BLAS using the cores left
            to each (default: every core this process may use, :func:`~hpu_fp8_loader.engine.layer_major.usable_cores`);
            the amax, expert counts and report are those of one thread to the bit with BLAS on as many threads
            (BLAS's own thread count may change a last bit; with BLAS held to one thread, every number agrees).
        channel_points: activation points (spec module names) whose max |x| per channel to record as well, into the
            result's ``channel_amax``.

    Returns:
        A :class:`~hpu_fp8_loader.CalibrationResult`; its ``measurements`` go to :func:`~hpu_fp8_loader.convert`.

    Raises:
        CheckpointNotFoundError: a shard file of ``model`` is missing.
        ConfigError: ``model`` has no config.json (or does not exist), config.json is invalid or sets arithmetic
            the engine does not compute (``hidden_act`` other than silu, ``rope_scaling``, sliding-window
            attention), or the tensors do not fit it.
        UnknownArchitectureError: config.json's model_type is not supported.
        SafetensorsFormatError: a shard is truncated or corrupt.
        CheckpointIndexError: the shard index is malformed or disagrees with the shards.
        NonFiniteError: an activation is NaN or inf (the message names the module and the windows); nothing is
            returned.
        DatasetError: the dataset cannot be read, lacks the text field or ``messages``, or holds no text.
        TokenizerError: the model has no tokenizer (and is no byte-level model), its tokenizer or chat template cannot
            be loaded or used, or gives ids beyond the vocabulary.
        HpuFp8Error: ``samples``, ``seq_len`` or ``batch_size`` is below 1, ``seq_len`` is beyond
            max_position_embeddings or the text holds fewer tokens than one window, an hpu-fp8 ``model`` fails the
            quick validation, or a layer does not fit in memory.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, calibrate, write_measurements
        >>> calibration = calibrate(TINY_MODELS["qwen2-bytes"], samples=8, seq_len=64)  # float32, on a CPU
        >>> calibration.measurements.amax["qwen2.layers.0.self_attn.qkv_proj"]
        4.144025802612305
        >>> write_measurements("measurements.json", calibration.measurements)
    """
    started = time.perf_counter()
    weights = open_weights(model, cache_bytes=0)  # layer-major: each layer is read once, nothing to cache
    d = weights.descriptor
    check_seq_len(seq_len, model, weights.checkpoint.config)
    ids, tokenizer_name, dataset_commit = dataset_tokens(
        model,
        d.vocab_size,
        dataset,
        limit=samples * seq_len,
        tokenizer=tokenizer,
        text_field=text_field,
        chat_template=chat_template,
        dataset_revision=dataset_revision,
    )
    observer = AmaxObserver(d.prefix, all_experts)
    config = EngineConfig.from_config(weights.checkpoint.config, d, str(weights.checkpoint.root / "config.json"))
    log.info("%s: %d tokens of text (%s tokens) for %d window(s) of %d", model, ids.size, tokenizer_name, samples, seq_len)
    ranges, channels = RangeObserver(d.prefix), ChannelAmaxObserver(d.prefix, channel_points)
    if report is None:
        forward_observer: Observer = TeeObserver(observer, ranges, channels)
    else:
        forward_observer = TeeObserver(report.calibration_observer(model, d, observer, ranges), channels)
    windows = token_windows(ids, samples, seq_len, batch_size, dataset)
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # the observer refuses what overflowed, by name
            run_layer_major(
                {str(model): ReferenceModel(weights, config, forward_observer)},
                windows,
                batch_size,
                scratch_dir=scratch_dir,
                progress=progress,
                threads=threads,
            )
    except NonFiniteError as exc:
        raise NonFiniteError(
            f"{exc}: a weight feeding it is not finite or the float32 arithmetic overflows; nothing was written"
        ) from None
    tokens, count = windows.size, len(windows)
    experts = d.moe.num_experts if d.moe else 0
    measurements = Measurements(
        provenance=MeasurementProvenance(
            kind=AmaxSourceKind.REFERENCE_ENGINE,
            dataset=str(dataset),
            samples=count,
            tokens=tokens,
            seq_len=seq_len,
            date=datetime.date.today().isoformat(),
            tool="hpu-fp8 calibrate" + (" --all-experts" if all_experts else ""),
            tool_version=__version__,
            tokenizer=tokenizer_name,
            dataset_revision=dataset_commit,
        ),
        model=ModelIdentity(model_type=d.model_type, num_hidden_layers=d.num_layers, moe_num_experts=experts),
        amax=observer.amax,
        expert_tokens=observer.expert_tokens,
    )
    dead = []
    for key, routed in observer.expert_tokens.items():
        if routed == 0:
            expert = names.expert_of(key)
            assert expert is not None  # the observer keys expert_tokens by names.expert_tokens_key
            dead.append(expert)
    spread = point_ranges(ranges.histograms, observer.amax)
    warning = range_warning(spread, "the calibration text")
    if report is not None:
        report.ranges = [r.to_dict() for r in spread]
    return CalibrationResult(
        measurements,
        tokenizer_name,
        tokens,
        time.perf_counter() - started,
        sorted(dead),
        spread,
        [warning] if warning else [],
        channels.amax,
    )


def check_outputs(model: str | Path, dataset: str | Path, outputs: Iterable[str | Path], force: bool) -> None:
    """Before hours of work, refuse outputs that could not or must not be written: an existing file
    without ``force``, a directory, a missing or read-only directory, or a file of the model (even
    its own config.json with ``force``) or the dataset itself (see ``check_output_file``)."""
    sources = [model] if str(dataset) == BUILTIN else [model, dataset]
    for path in outputs:
        check_output_file(path, force, sources)


def write_fastdeploy_file(path: str | Path, measurements: Measurements, force: bool = False) -> None:
    """The same amax in FastDeploy's measurement-mode text format (``key<TAB>float`` lines), written atomically;
    an existing ``path`` is replaced only with ``force``."""
    lines = [f"{names.fastdeploy_key_from_module(module)}\t{value!r}\n" for module, value in measurements.amax.items()]
    write_text_atomically(path, "".join(lines), force)
