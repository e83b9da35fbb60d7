"""Files of what the hook hands FastDeploy: one rank's parameters, or pre-sharded ``rank{N}/`` folders.

``hpu-fp8 map`` writes exactly the tensors the plugin would set on a rank, under FastDeploy's
parameter paths and with their final dtypes, so anyone with FastDeploy at hand can check the mapping
without an HPU. ``--all-ranks`` writes FastDeploy's pre-sharded layout (docs/fastdeploy.md section 2, "Load dispatch"): one
``rank{r}/`` folder per tensor-parallel rank in the legacy key layout, which FastDeploy loads
without splitting anything itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.fastdeploy.legacy import check_exportable, export_legacy
from hpu_fp8_loader.fastdeploy.mapping import MappedPiece, Parallelism, ParameterSpec, map_rank, parameter_specs
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE
from hpu_fp8_loader.io.file_output import atomic_file, check_output_file
from hpu_fp8_loader.io.own_files import copy_new
from hpu_fp8_loader.io.safetensors_file import dtype_name
from hpu_fp8_loader.io.writer import (
    PlannedTensor,
    Shard,
    ShardFile,
    check_apart,
    clear_staging,
    prepare_output_dir,
    publish_output_dir,
)
from hpu_fp8_loader.sources.resolve import SPEC_PATTERNS, local_or_hub

__all__ = ["RankFile", "rank_parameters", "write_presharded", "write_rank_file"]


@dataclass
class RankFile:
    path: Path
    parameters: int
    bytes: int


def rank_parameters(src: str | Path, par: Parallelism | None = None, revision: str | None = None) -> Iterator[MappedPiece]:
    """Every parameter value FastDeploy's rank ``par`` gets from the hpu-fp8 checkpoint at ``src``, as the hook sets it.

    The checkpoint is validated quickly first; values come in model order under FastDeploy's parameter
    names, stacked MoE parameters one expert at a time (``piece.expert``). ``par`` defaults to one rank (TP 1, EP 1).
    Lets anyone check the mapping without an HPU; FastDeploy's multipliers (240 / amax) are made here, from the
    descales the checkpoint stores, and every scale is checked finite and positive on its way out. Values are
    read lazily, a rank's share at a time, and value-checked as they are read.

    Args:
        src: the hpu-fp8 checkpoint directory (fp8_max 240, no modules kept in BF16: what FastDeploy serves), or a
            Hub repo id (``ORG/NAME``) when no such local path exists: downloaded, or found in the cache offline.
        par: the rank: tensor- and expert-parallel size and index.
        revision: the Hub branch, tag or commit when ``src`` is a repo id (``main`` by default).

    Returns:
        An iterator of :class:`~hpu_fp8_loader.MappedPiece` (``name``, ``array``, ``expert``). The checks on ``par``
        and the checkpoint's fp8_max run when iteration starts.

    Raises:
        HpuFp8Error: ``src`` fails the quick validation (at the call); while iterating: fp8_max is not 240 (retarget
            it), modules are kept in BF16, or FastDeploy's formula gives a scale that is not finite and positive.
        ConfigError: ``par`` cannot serve this model (a width it does not split evenly, fewer KV heads than ranks,
            expert parallelism for a dense model or one that does not divide the experts); raised while iterating.
        NonFiniteError: a value read holds a NaN code, a value beyond ±240 or a NaN/inf kept value (while iterating).
        CheckpointNotFoundError: ``src`` is not a directory; as a repo id: missing, gated or private on the Hub, a
            revision that does not exist, or offline and not in the cache.
        HubError: the Hub cannot be reached or refused the request.
        NotHpuFp8CheckpointError: ``src`` is not an hpu-fp8 checkpoint.
        UnsupportedFormatVersionError: ``src`` declares another format_version.
        UnknownArchitectureError: config.json's model_type is not supported.

    Example:
        >>> from hpu_fp8_loader import Parallelism, rank_parameters
        >>> for piece in rank_parameters("qwen2-fp8", Parallelism(tp_size=2, tp_rank=0)):
        ...     print(piece.name, piece.array.dtype, piece.array.shape)
        qwen2.embed_tokens.embeddings.weight bfloat16 (128, 128)
        qwen2.layers.0.input_layernorm.weight bfloat16 (128,)
        ...
    """
    opened = open_validated(local_or_hub(src, revision, SPEC_PATTERNS))
    return map_rank(opened.checkpoint, opened.qc, opened.descriptor, par or Parallelism())


def write_rank_file(src: str | Path, out: str | Path, par: Parallelism, force: bool = False) -> RankFile:
    """One rank's FastDeploy parameters as a single safetensors file, written atomically. ``src`` is a local
    directory (the command resolves a Hub repo id first)."""
    out = Path(out)
    check_apart(out, [src])
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    check_output_file(out, force)
    opened = open_validated(src)
    checkpoint, qc, descriptor = opened.checkpoint, opened.qc, opened.descriptor
    specs = parameter_specs(descriptor, qc.kv_cache_scheme, par, qc.kept_bf16)
    with atomic_file(out, replace=force) as staging:  # never a fixed FILE.partial, which may be a planted link
        shard = Shard(staging.name, tuple(PlannedTensor(name, spec.dtype, spec.shape) for name, spec in specs.items()))
        metadata = {"format": "pd", "tp": f"{par.tp_rank}/{par.tp_size}", "ep": f"{par.ep_rank}/{par.ep_size}"}
        target = ShardFile(staging.parent, shard, metadata)
        target.create()
        _write_pieces(target, map_rank(checkpoint, qc, descriptor, par), specs)
    return RankFile(out, len(specs), shard.nbytes)


def _write_pieces(target: ShardFile, pieces: Iterable[MappedPiece], specs: dict[str, ParameterSpec]) -> None:
    """Every mapped piece into ``target``, each checked against its parameter's dtype and shape; then closed."""
    written: dict[str, int] = {}
    for piece in pieces:
        spec = specs[piece.name]
        shape = spec.shape[1:] if piece.expert is not None else spec.shape
        if tuple(piece.array.shape) != shape or dtype_name(piece.array.dtype) != spec.dtype:
            raise RuntimeError(  # a bug of ours, not an input a user can fix
                f"internal error: {piece.name} mapped to {piece.array.dtype}{list(piece.array.shape)}, expected {spec}"
            )
        if piece.expert is None:
            target.write(piece.name, piece.array)
        else:
            target.write(piece.name, piece.array[None], piece.expert)
        written[piece.name] = written.get(piece.name, 0) + 1
    target.close()
    missing = [name for name in specs if name not in written]
    if missing:
        raise RuntimeError(f"internal error: parameters left unmapped: {', '.join(missing[:5])}")


def write_presharded(src: str | Path, out: str | Path, tp: int, force: bool = False) -> list[Path]:
    """``out/rank{r}/`` for every tensor-parallel rank, in the legacy key layout, plus ``out/config.json``.

    ``src`` is a local directory (the command resolves a Hub repo id first), validated before the output directory is
    made (each rank's export checks it again, cheaply).
    """
    check_exportable(src, open_validated(src).descriptor, Parallelism(tp))  # refused before the output directory exists
    staging = prepare_output_dir(out, force, [src])
    clear_staging(staging)
    ranks = []
    for r in range(tp):
        ranks.append(export_legacy(src, staging / f"rank{r}", rank=Parallelism(tp, r)).out)
    copy_new(staging / "rank0" / CONFIG_FILE, staging / CONFIG_FILE)
    publish_output_dir(staging, out, manifest=True, force=force)
    return [Path(out) / p.name for p in ranks]
