"""Accuracy evidence: the emulated FP8 model against the BF16 model on held-out text.

The reference is the float32 engine on the BF16 source; the FP8 side is :class:`Fp8Emulator` on the
parameters the FastDeploy mapping produces. Text is the held-out part of the built-in data (never
the calibration part), or a file. Ablations say where the error comes from: ``weights-only`` (FP8
weights, float32 activations) and ``no-kv-fp8`` (FP8 linears, BF16 attention and KV cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.engine.fp8 import EmulationOptions, Fp8Emulator
from hpu_fp8_loader.engine.layer_major import LayerModel, LayerProgress, run_layer_major
from hpu_fp8_loader.engine.model import Observer, ReferenceModel
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.errors import HpuFp8Error, NonFiniteError
from hpu_fp8_loader.numerics.bootstrap import bootstrap_ratio_interval
from hpu_fp8_loader.quality import DEFAULT_EVAL_SAMPLES, DEFAULT_EVAL_SEQ_LEN
from hpu_fp8_loader.quality.datasets import BUILTIN, check_seq_len, dataset_tokens, token_windows
from hpu_fp8_loader.quality.observers import CheckpointFp8, RangeObserver
from hpu_fp8_loader.quality.ranges import point_ranges, range_warning
from hpu_fp8_loader.spec.fp8 import GAUDI2_FP8_MAX

if TYPE_CHECKING:
    from hpu_fp8_loader.quality.report import Report

__all__ = ["DEFAULT_VARIANTS", "VARIANTS", "EvalRow", "EvaluationResult", "check_same_model", "chosen_variants", "evaluate"]

VARIANTS = {
    "fp8": EmulationOptions(),
    "weights-only": EmulationOptions(weights_only=True),
    "no-kv-fp8": EmulationOptions(fp8_attention=False),
    "per-token": EmulationOptions(per_token=True),
}
# The rows eval computes unless told otherwise; "per-token" (a ceiling FastDeploy cannot serve) only when asked for.
DEFAULT_VARIANTS = ("fp8", "weights-only", "no-kv-fp8")


def chosen_variants(weights_only: bool = False, no_kv_fp8: bool = False, per_token: bool = False) -> tuple[str, ...]:
    """The rows to compute: the default rows when no ablation is asked for (plus ``per-token`` when asked for), else
    the FP8 row and those asked for.

    Example:
        >>> chosen_variants(weights_only=True)
        ('fp8', 'weights-only')
        >>> chosen_variants(per_token=True)
        ('fp8', 'weights-only', 'no-kv-fp8', 'per-token')
    """
    asked = {"weights-only": weights_only, "no-kv-fp8": no_kv_fp8}
    rows = DEFAULT_VARIANTS if not any(asked.values()) else ("fp8", *(name for name, on in asked.items() if on))
    return (*rows, *(["per-token"] if per_token else []))


@dataclass
class EvalRow:
    """One variant's accuracy against the BF16 model (a row of :class:`EvaluationResult`).

    ``perplexity_increase`` (read-only) is ``perplexity_fp8 / perplexity_bf16 - 1``. ``top1_agreement_interval``
    and ``mean_kl_interval`` are 95% bootstrap percentile intervals (low, high) over windows
    (:func:`~hpu_fp8_loader.numerics.bootstrap.bootstrap_ratio_interval`); ``None`` from a single window or for a
    row made by hand. Few windows give rough intervals: the default 16 is the least to read them by. ``window_kl``
    is the KL summed over each window's tokens, in window order: what a paired comparison of two checkpoints on the
    same windows resamples (:func:`~hpu_fp8_loader.numerics.bootstrap.bootstrap_gap_closed`).
    """

    variant: str
    top1_agreement: float
    mean_kl: float  # KL(bf16 || fp8) per token, nats
    relative_logit_rmse: float
    perplexity_bf16: float
    perplexity_fp8: float
    top1_agreement_interval: tuple[float, float] | None = None
    mean_kl_interval: tuple[float, float] | None = None
    window_kl: list[float] = field(default_factory=list)

    @property
    def perplexity_increase(self) -> float:
        return self.perplexity_fp8 / self.perplexity_bf16 - 1


@dataclass
class EvaluationResult:
    """The accuracy of the emulated FP8 model against the BF16 model: one row per variant.

    Attributes:
        tokens: held-out tokens run through both models.
        tp: the tensor parallelism emulated.
        dataset: the dataset, as given (``"builtin"`` for the held-out 10% of the built-in text).
        rows: one ``EvalRow`` per variant computed (``"fp8"``, ``"weights-only"``, ``"no-kv-fp8"``), each with
            ``top1_agreement`` (share of next-token predictions that agree), ``mean_kl`` (KL(bf16 || fp8) per
            token, nats), ``relative_logit_rmse``, ``perplexity_bf16``, ``perplexity_fp8`` and
            ``perplexity_increase`` (``perplexity_fp8 / perplexity_bf16 - 1``), and 95% bootstrap intervals
            ``top1_agreement_interval`` and ``mean_kl_interval`` (low, high): windows resampled 1,000 times with a
            fixed seed, since the tokens of one window are correlated.
        warnings: such as a quantization point whose amax / median |x| on the held-out text exceeds what E4M3 at ±240
            holds (:mod:`~hpu_fp8_loader.quality.ranges`), or FP8 attention costing far more than FP8 linears (convert
            again with ``kv_cache="none"``).
        tokenizer: which tokenizer made the tokens (the BF16 source's own, such as ``"tokenizer.json"``, or
            ``"bytes"``), as :class:`~hpu_fp8_loader.CalibrationResult` names it.
        windows: the windows of ``tokens`` (the units the bootstrap intervals resample).

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, evaluate
        >>> evaluation = evaluate(TINY_MODELS["qwen2-bytes"], "qwen2-fp8", samples=2, seq_len=64)
        >>> for row in evaluation.rows:
        ...     print(f"{row.variant:>12}: top-1 agreement {row.top1_agreement:.3f}, mean KL {row.mean_kl:.2e}")
                 fp8: top-1 agreement 0.976, mean KL 8.64e-03
        weights-only: top-1 agreement 0.992, mean KL 1.46e-03
           no-kv-fp8: top-1 agreement 0.992, mean KL 4.36e-03
    """

    tokens: int
    tp: int
    dataset: str
    rows: list[EvalRow] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tokenizer: str = ""
    windows: int = 0

    def to_dict(self) -> dict:
        data = asdict(self)
        for row, obj in zip(data["rows"], self.rows, strict=True):
            row["perplexity_increase"] = obj.perplexity_increase
        return data


def _log_softmax_in_place(logits: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``logits`` turned into log-probabilities in place (``scratch``: an array of its shape for the exponentials):
    the arithmetic of ``shifted - log(sum(exp(shifted)))`` without two more arrays of the chunk's logits."""
    logits -= logits.max(axis=-1, keepdims=True)
    logits -= np.log(np.exp(logits, out=scratch).sum(axis=-1, keepdims=True))
    return logits


class _Accumulator:
    """One row's sums over every window, and top-1 agreement and KL per window as well, for the intervals."""

    def __init__(self) -> None:
        self.agree = self.count = 0
        self.kl = self.err = self.norm = self.nll_ref = self.nll_fp8 = 0.0
        self.window_agree: list[np.ndarray] = []
        self.window_kl: list[np.ndarray] = []
        self.window_count: list[np.ndarray] = []

    def add(self, ref: np.ndarray, fp8: np.ndarray, targets: np.ndarray) -> None:
        """One chunk's windows, in three float64 arrays of its logits' shape (at 300B's 103,424-token vocabulary, 0.8
        GB each for 2 windows of 512): each sum is the one the plain expressions give, in place where they would
        make new arrays."""
        ref, fp8 = ref[:, :-1].astype(np.float64), fp8[:, :-1].astype(np.float64)
        agree = (ref.argmax(-1) == fp8.argmax(-1)).sum(axis=1)
        scratch = np.subtract(fp8, ref)
        self.err += float(np.square(scratch, out=scratch).sum())
        self.norm += float(np.square(ref, out=scratch).sum())
        lp_ref, lp_fp8 = _log_softmax_in_place(ref, scratch), _log_softmax_in_place(fp8, scratch)
        picked = targets[..., None]
        self.nll_ref -= float(np.take_along_axis(lp_ref, picked, -1).sum())
        self.nll_fp8 -= float(np.take_along_axis(lp_fp8, picked, -1).sum())
        difference = np.subtract(lp_ref, lp_fp8, out=lp_fp8)
        kl = np.multiply(np.exp(lp_ref, out=scratch), difference, out=scratch).sum(axis=(1, 2))
        self.window_agree.append(agree)
        self.window_kl.append(kl)
        self.window_count.append(np.full(len(targets), targets.shape[1]))
        self.agree += int(agree.sum())
        self.count += targets.size
        self.kl += float(kl.sum())

    def row(self, variant: str) -> EvalRow:
        return EvalRow(
            variant,
            self.agree / self.count,
            self.kl / self.count,
            (self.err / self.norm) ** 0.5,
            float(np.exp(self.nll_ref / self.count)),
            float(np.exp(self.nll_fp8 / self.count)),
            *self._intervals(),
            [float(kl) for kl in np.concatenate(self.window_kl)],
        )

    def _intervals(self) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        """Top-1 agreement's and mean KL's bootstrap intervals; none from one window (it cannot show its spread)."""
        counts = np.concatenate(self.window_count)
        if len(counts) < 2:
            return None, None
        agree, kl = np.concatenate(self.window_agree), np.concatenate(self.window_kl)
        return bootstrap_ratio_interval(agree, counts), bootstrap_ratio_interval(kl, counts)


def evaluate(
    bf16_source: str | Path,
    fp8_checkpoint: str | Path,
    dataset: str | Path = BUILTIN,
    samples: int = DEFAULT_EVAL_SAMPLES,
    seq_len: int = DEFAULT_EVAL_SEQ_LEN,
    tp: int = 1,
    variants: tuple[str, ...] = DEFAULT_VARIANTS,
    decode_attention: bool = False,
    *,
    tokenizer: str = "auto",
    text_field: str = "text",
    chat_template: bool = False,
    dataset_revision: str | None = None,
    report: Report | None = None,
    scratch_dir: str | Path | None = None,
    progress: Callable[[LayerProgress], object] | None = None,
    threads: int | None = None,
) -> EvaluationResult:
    """Top-1 agreement, mean KL(bf16 || fp8), relative logit RMSE and both perplexities, per variant.

    Accuracy evidence without a Gaudi: the reference is the float32 engine on the BF16 source; the FP8 side
    emulates FastDeploy's HPU kernels on exactly the parameters the loader hook hands FastDeploy. Text is held out
    from calibration. ``fp8_checkpoint`` passes the quick validation before anything runs; its values are checked
    as the emulator maps them. Before any forward, too: the two must be the same model (:func:`check_same_model`),
    and a window must hold 2 tokens (one next-token prediction) and fit max_position_embeddings.

    Layer-major (:func:`~hpu_fp8_loader.engine.layer_major.run_layer_major`): all windows go through layer L of the
    reference and of every row before layer L+1 is read; each layer of the BF16 source is read once, and each layer
    of ``fp8_checkpoint`` mapped once for all rows, a part at a time (one expert of an MoE layer:
    :func:`~hpu_fp8_loader.quality.calibrate.calibrate`), the rows in lockstep. Memory: the largest part of a layer
    of each model in float32, the heads as stored (:func:`~hpu_fp8_loader.engine.model.head_product`), 4 windows'
    activations
    and logits, and the hidden states of all windows per model when they fit a quarter of the memory budget (else
    in scratch files in ``scratch_dir``). The rows are those of running the windows 4 at a time, to the bit.

    Args:
        bf16_source: the BF16 source checkpoint directory ``fp8_checkpoint`` was converted from.
        fp8_checkpoint: the hpu-fp8 checkpoint directory (fp8_max 240: what FastDeploy serves).
        dataset: ``"builtin"`` (the held-out last 10% of the built-in text, never calibrated on), a UTF-8 ``.txt``
            file, a ``.jsonl`` file of ``{"text": ...}`` lines, a ``.json`` array of such records, a ``.csv`` or
            ``.parquet`` file with a ``text`` column, a directory of such files, or a Hub dataset repo id ``ORG/NAME``
            (from the Hugging Face cache; a local path wins).
        samples: how many windows to run (fewer when the text holds fewer); by default 16 of 128 tokens, the 2,048
            tokens the demo evaluates. The windows are what the bootstrap intervals resample: with one, there are
            none.
        seq_len: tokens per window: at least 2, at most the model's ``max_position_embeddings``.
        tp: the tensor parallelism to emulate: every rank's share runs, and row-parallel outputs are reduced as
            bf16 partial sums.
        variants: the rows to compute: ``"fp8"`` (the checkpoint as FastDeploy runs it), ``"weights-only"`` (FP8
            weights, float32 activations), ``"no-kv-fp8"`` (FP8 linears, BF16 attention and KV cache; skipped when
            the checkpoint already keeps attention in BF16), ``"per-token"`` (every FP8 linear's input cast with its
            own token's scale, attention as served: a ceiling for static scales that FastDeploy's HPU format cannot
            serve; not among the default rows).
        decode_attention: quantize the unnormalised exp scores as FastDeploy's decode path does (prefill form
            otherwise).
        tokenizer: ``"auto"`` (the BF16 source's own tokenizer; refused when it has none, unless a byte-level
            model) or ``"bytes"``.
        text_field: the JSON key, CSV column or parquet column holding each record's text.
        chat_template: render each record's ``messages`` through the source's chat template instead.
        dataset_revision: the branch, tag or commit of a Hub ``dataset``.
        report: a :class:`~hpu_fp8_loader.Report` that collects, during the reference forward, each linear's output
            error against the checkpoint's FP8 weights and scales, held-out amax and expert load, and these rows;
            write it afterwards with ``report.write(DIR)``.
        scratch_dir: where the hidden states of all windows (one store per model: the BF16 reference and each
            row) wait between layers when they do not fit a quarter of the memory budget: scratch files, unlinked
            as soon as they are mapped; default: the system temp directory.
        progress: called after each step (4 windows through one stage of a layer, or the head, of one model) with a
            :class:`~hpu_fp8_loader.engine.layer_major.LayerProgress`: steps done, their total, the layer.
        threads: chunks of 4 windows run at once on threads of their own (default: every core this process may
            use); the rows are those of one thread to the bit with BLAS on as many threads (BLAS's own thread
            count may change a last bit; with BLAS held to one thread, every number agrees).

    Returns:
        An :class:`~hpu_fp8_loader.EvaluationResult`: one row per variant, each with 95% bootstrap intervals of
        top-1 agreement and mean KL (windows resampled), and a warning when FP8 attention costs far more than
        FP8 linears.

    Raises:
        HpuFp8Error: an unknown variant; ``seq_len`` below 2 or beyond max_position_embeddings; ``fp8_checkpoint``
            fails the quick validation, is not at fp8_max 240 or keeps modules in BF16; the two are different
            models; the dataset holds fewer tokens than one window.
        DatasetError: the dataset cannot be read, lacks the text field or ``messages``, or holds no text.
        TokenizerError: the source has no tokenizer (and is no byte-level model), its tokenizer or chat template
            cannot be loaded or used, or gives ids beyond the vocabulary.
        NonFiniteError: logits or an emulated value are NaN or inf (a weight so large that float32 overflows).
        CheckpointNotFoundError: ``fp8_checkpoint`` is not a directory, or a shard is missing.
        NotHpuFp8CheckpointError: ``fp8_checkpoint`` is not an hpu-fp8 checkpoint.
        ConfigError: a config.json is missing or invalid, sets arithmetic the engine does not compute, or ``tp``
            does not split the model.
        UnknownArchitectureError: a config.json's model_type is not supported.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, evaluate
        >>> evaluation = evaluate(TINY_MODELS["qwen2-bytes"], "qwen2-fp8", samples=2, seq_len=64, variants=("fp8",))
        >>> row = evaluation.rows[0]
        >>> row.variant, round(row.top1_agreement, 3), f"{row.perplexity_increase:+.1%}"
        ('fp8', 0.976, '-0.7%')
        >>> evaluation.warnings
        []
    """
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise HpuFp8Error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if seq_len < 2:
        raise HpuFp8Error(f"seq_len {seq_len} is too short: next-token evaluation needs at least 2 tokens per window")
    fp8 = open_validated(fp8_checkpoint)
    reference = open_weights(bf16_source, cache_bytes=0)  # layer-major: each layer is read once, nothing to cache
    check_same_model(bf16_source, reference.descriptor, fp8_checkpoint, fp8.descriptor)
    check_seq_len(seq_len, bf16_source, reference.checkpoint.config)
    ids, tokenizer_name, _ = dataset_tokens(
        bf16_source,
        reference.descriptor.vocab_size,
        dataset,
        split="held-out",
        limit=samples * seq_len,
        tokenizer=tokenizer,
        text_field=text_field,
        chat_template=chat_template,
        dataset_revision=dataset_revision,
    )
    windows = token_windows(ids, samples, seq_len, dataset=dataset)
    emulator = Fp8Emulator(fp8_checkpoint, tp)  # the parameters, mapped a part at a time, shared by every row
    ranges = RangeObserver(reference.descriptor.prefix)
    if report is None:
        observer: Observer = ranges
    else:
        observer = report.evaluation_observer(bf16_source, reference.descriptor, fp8.checkpoint, ranges)
    models: dict[str, LayerModel] = {str(bf16_source): ReferenceModel(reference, observer=observer)}
    rows: dict[str, str] = {}  # model label -> its row
    for name in variants:
        options = VARIANTS[name]
        variant = emulator.with_options(dataclasses.replace(options, decode_attention=decode_attention))
        if name == "no-kv-fp8" and not variant.fp8_attention and variant.qc.kv_cache_scheme.value == "none":
            continue  # the checkpoint already keeps attention in BF16: the full row is this ablation
        label = f"{fp8_checkpoint} ({name} row)"
        models[label], rows[label] = variant, name
    accumulators = {name: _Accumulator() for name in rows.values()}
    reference_logits: list[np.ndarray] = []  # the reference's logits of the chunk whose rows are being added

    def add(part: slice, label: str, logits: np.ndarray) -> None:
        if label not in rows:
            _check_finite(logits, f"{bf16_source}: the BF16 model's logits")
            reference_logits[:] = [logits]
            return
        _check_finite(logits, f"{fp8_checkpoint}: the emulated FP8 logits ({rows[label]} row)")
        accumulators[rows[label]].add(reference_logits[0], logits, windows[part, 1:])

    with np.errstate(over="ignore", invalid="ignore"):  # what overflowed is refused by name
        run_layer_major(models, windows, 4, add, scratch_dir, progress=progress, threads=threads)
    tokens = windows.size
    table = [accumulators[name].row(name) for name in accumulators]
    result = EvaluationResult(tokens, tp, str(dataset), table, tokenizer=tokenizer_name, windows=len(windows))
    served = CheckpointFp8(fp8.checkpoint)
    spread = point_ranges(
        ranges.histograms, {point: scale * GAUDI2_FP8_MAX for point in ranges.histograms if (scale := served.act_scale(point))}
    )
    for warning in (range_warning(spread, "held-out text, at the checkpoint's scales"), attention_warning(result.rows)):
        if warning:
            result.warnings.append(warning)
    if report is not None:
        report.evaluation = result.to_dict()
        report.ranges = [r.to_dict() for r in spread]
    return result


# Fields that follow from model_type, so naming them too would only repeat its difference.
_DERIVED = frozenset({"architecture", "prefix"})


def _model_shape(d: ModelDescriptor) -> dict[str, object]:
    """The descriptor's fields by name, the MoE ones flattened to ``moe.<field>`` and ``moe`` itself shown
    as "dense" or "MoE", so a message can name each difference with both values, once."""
    shape = {f.name: getattr(d, f.name) for f in fields(d) if f.name not in _DERIVED}
    shape["moe"] = "MoE" if d.moe else "dense"
    if d.moe:
        shape.update({f"moe.{f.name}": getattr(d.moe, f.name) for f in fields(d.moe)})
    return shape


def _shown(value: object) -> str:
    """A value as config.json spells it: ``true``, not Python's ``True``."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_same_model(source: str | Path, ours: ModelDescriptor, checkpoint: str | Path, theirs: ModelDescriptor) -> None:
    """Refuse to compare two different models, naming each field that differs with both values.

    Two different models either end in a numpy broadcast error halfway through (another vocabulary) or,
    where the arrays happen to fit (other heads, another architecture), print a table that measures
    nothing but the mismatch.
    """
    a, b = _model_shape(ours), _model_shape(theirs)
    differences = [f"{name} {_shown(a[name])} vs {_shown(b[name])}" for name in a if name in b and a[name] != b[name]]
    if differences:
        raise HpuFp8Error(
            f"{source} and {checkpoint} are different models ({', '.join(differences)}); "
            "evaluate a checkpoint against the BF16 source it was converted from"
        )


def _check_finite(logits: np.ndarray, what: str) -> None:
    """Refuse logits that are not finite: a weight so large the float32 arithmetic overflowed (a KL or a
    perplexity of NaN would otherwise be printed as a result)."""
    if not np.isfinite(logits).all():
        raise NonFiniteError(f"{what} are not finite: a weight is so large that the float32 arithmetic overflows")


def attention_warning(rows: list[EvalRow]) -> str | None:
    """A warning when FP8 attention costs far more than FP8 linears: more than twice their KL, and 0.01 nats more."""
    by_variant = {row.variant: row for row in rows}
    if "fp8" not in by_variant or "no-kv-fp8" not in by_variant:
        return None
    full, linears = by_variant["fp8"].mean_kl, by_variant["no-kv-fp8"].mean_kl
    if full > 2 * linears and full - linears > 0.01:
        return (
            f"FP8 attention and KV cache cost far more than FP8 linears (KL {full:.4f} vs {linears:.4f}): "
            "--kv-cache none keeps them in BF16, which has not yet been seen working on a Gaudi "
            "(Qwen2-7B-Instruct fell from GSM8K 0.77 to 0.03 with FP8 attention and KV cache on another Gaudi stack)"
        )
    return None
