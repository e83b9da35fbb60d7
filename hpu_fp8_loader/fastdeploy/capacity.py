"""How many KV-cache tokens fit on one Gaudi rank after the weights, by FastDeploy's HPU worker's own arithmetic.

FastDeploy does not ask the device how much memory it has. Its HPU worker takes 96 GiB on every device, keeps
``gpu_memory_utilization`` of it, subtracts 768 MiB and the peak its profile run allocated (the weights, a KV cache
sized for the profile batch, the activations), and divides the rest into KV blocks of ``block_size`` tokens. Every
figure below is read from FastDeploy's code at ``develop`` ``8c3513a4`` (docs/fastdeploy.md, "KV-cache capacity",
cites each); only the profile run's activations are not modelled: they depend on kernels we cannot run here, so
the tokens are an upper bound, and FastDeploy's log line ``num_blocks_local`` on the Gaudi box says the real one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpu_fp8_loader.spec.choices import Target

__all__ = ["DEVICE_HBM_BYTES", "FastDeployMemory", "KvCapacity", "kv_capacity"]

GIB, MIB = 2**30, 2**20
# The devices' HBM, as Intel publishes it (96 GB Gaudi2, 128 GB Gaudi3; docs/fastdeploy.md cites the source), read
# as GiB: FastDeploy's own constant for a Gaudi2 is 96 GiB [inferred]. Shown beside FastDeploy's assumption only.
DEVICE_HBM_BYTES = {Target.GAUDI2: 96 * GIB, Target.GAUDI3: 128 * GIB}
# FastDeploy's --max-model-len default, suggested for a config.json without max_position_embeddings.
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class FastDeployMemory:
    """FastDeploy's numbers for sizing the KV cache on an HPU, each as its code has it (defaults of its server).

    Attributes:
        assumed_hbm_bytes: the device memory the HPU worker assumes, whatever the device (96 GiB).
        reserved_bytes: memory the HPU worker keeps for use outside paddle (768 MiB).
        gpu_memory_utilization: the share of ``assumed_hbm_bytes`` it may use (``--gpu-memory-utilization``, 0.9).
        block_size: tokens per KV block (``--block-size``, 64).
        enc_dec_block_num: blocks a sequence keeps beyond its length for decoding (``FD_ENC_DEC_BLOCK_NUM``, 2).
        max_blocks: the most blocks a rank gets, however much memory is left (40000).
        max_num_batched_tokens: tokens of the profile run's batch, and the most a step schedules
            (``--max-num-batched-tokens``: 8192 under the v1 KV-cache scheduler, which the HPU keeps).
        max_num_seqs_limit: the largest ``--max-num-seqs`` FastDeploy accepts (256).
        min_max_model_len: the smallest ``--max-model-len`` FastDeploy accepts (16).
    """

    assumed_hbm_bytes: int = 96 * GIB
    reserved_bytes: int = 768 * MIB
    gpu_memory_utilization: float = 0.9
    block_size: int = 64
    enc_dec_block_num: int = 2
    max_blocks: int = 40000
    max_num_batched_tokens: int = 8192
    max_num_seqs_limit: int = 256
    min_max_model_len: int = 16

    def blocks_per_sequence(self, tokens: int) -> int:
        """KV blocks one sequence of ``tokens`` holds, with its decode slack (FastDeploy's ``CacheConfig.postprocess``)."""
        return (tokens + self.block_size - 1 + self.enc_dec_block_num * self.block_size) // self.block_size

    def profile_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Blocks of the KV cache the profile run allocates (and counts in its peak) before measuring."""
        return self.blocks_per_sequence(max_num_batched_tokens // max_num_seqs) * max_num_seqs

    def budget(self) -> float:
        """Bytes for weights, profile run and KV cache: ``assumed_hbm_bytes x gpu_memory_utilization - reserve``."""
        return self.assumed_hbm_bytes * self.gpu_memory_utilization - self.reserved_bytes

    def blocks(self, weight_bytes: int, block_bytes: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """The KV blocks a rank gets: what is left of the budget after the reserve, the weights and the profile
        run's cache, in whole blocks, at most ``max_blocks``; zero or less when nothing is left."""
        profile = self.profile_blocks(max_num_batched_tokens, max_num_seqs) * block_bytes
        available = self.budget() - weight_bytes - profile
        return min(self.max_blocks, int(available // block_bytes))


@dataclass
class KvCapacity:
    """The KV cache one rank gets on a Gaudi, and the server options that fit it (``DeploymentPlan.capacity``).

    Attributes:
        device: ``"gaudi2"`` or ``"gaudi3"``.
        device_hbm_bytes: the device's HBM (96 GiB, 128 GiB).
        assumed_hbm_bytes: what FastDeploy's HPU worker sizes for on every device (96 GiB): on a Gaudi3, the rest
            holds no KV cache.
        budget_bytes: ``assumed_hbm_bytes x gpu_memory_utilization - reserve``: for weights, profile run and KV cache.
        weight_bytes: the rank's parameters (``DeploymentPlan.total_bytes_per_rank``).
        profile_kv_bytes: the KV cache the profile run allocates (and counts in its peak) for the suggested options.
        block_size: tokens per block; ``block_bytes``: bytes of one block on this rank (K and V of every layer).
        blocks: KV blocks the rank gets (FastDeploy takes the smallest over the ranks; here every rank is alike).
        kv_tokens: ``blocks x block_size``: an upper bound, as the profile run's activations are not counted.
        max_model_len: the ``--max-model-len`` given, or the suggested one: the model's max_position_embeddings (or
            FastDeploy's default 2048 when config.json has none), shortened to what one sequence's blocks fit.
        max_num_seqs: suggested ``--max-num-seqs``: as many sequences as hold ``max_model_len`` tokens each at once
            (blocks // blocks a sequence needs), at most 256.
        max_num_batched_tokens: suggested ``--max-num-batched-tokens``: 8192, or ``max_model_len x max_num_seqs``
            when smaller (FastDeploy refuses a larger one).
        fits: whether FastDeploy can serve one sequence of ``max_model_len`` tokens with these options.
        problem: why not, in a line (empty when it fits).
    """

    device: str
    device_hbm_bytes: int
    assumed_hbm_bytes: int
    budget_bytes: int
    weight_bytes: int
    profile_kv_bytes: int
    block_size: int
    block_bytes: int
    blocks: int
    kv_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    fits: bool
    problem: str = ""


def kv_capacity(
    weight_bytes: int,
    kv_bytes_per_token: int,
    device: Target | str,
    max_model_len: int | None = None,
    max_position_embeddings: int | None = None,
    memory: FastDeployMemory | None = None,
) -> KvCapacity:
    """The KV-cache tokens a rank holding ``weight_bytes`` gets from FastDeploy's HPU worker, and options that fit.

    The profile run's KV cache depends on the options (``max_num_batched_tokens`` tokens in ``max_num_seqs``
    sequences), so each option is checked with its own profile cache: ``max_model_len`` is the longest a single
    sequence gets (at most the model's ``max_position_embeddings``), ``max_num_seqs`` the most sequences of it that
    fit at once. Fits when FastDeploy's own checks pass: ``max_model_len`` at least 16, and the blocks at least
    ``max_model_len // block_size + enc_dec_block_num``.

    Example:
        >>> capacity = kv_capacity(8 * 2**30, 57_344, "gaudi2", max_position_embeddings=32768)
        >>> capacity.max_model_len, capacity.max_num_seqs, capacity.fits
        (32768, 43, True)
    """
    device = Target(device)
    fd = memory or FastDeployMemory()
    block_bytes = kv_bytes_per_token * fd.block_size

    def blocks_with(length: int, seqs: int) -> tuple[int, int]:
        """The blocks left when serving ``seqs`` sequences of ``length``, and the batched tokens that takes."""
        batched = min(fd.max_num_batched_tokens, length * seqs)
        return fd.blocks(weight_bytes, block_bytes, batched, seqs), batched

    one = fd.blocks(weight_bytes, block_bytes, fd.max_num_batched_tokens, 1)  # one sequence, the largest profile batch
    longest = (one - fd.enc_dec_block_num) * fd.block_size  # what FastDeploy's check lets one sequence have
    length = max_model_len if max_model_len is not None else min(max_position_embeddings or DEFAULT_MAX_MODEL_LEN, longest)
    needed = length // fd.block_size + fd.enc_dec_block_num
    fits = length >= fd.min_max_model_len and blocks_with(length, 1)[0] >= needed
    seqs = 1
    if fits:
        at_once = [
            m for m in range(1, fd.max_num_seqs_limit + 1) if blocks_with(length, m)[0] >= m * fd.blocks_per_sequence(length)
        ]
        seqs = max(at_once, default=1)
    blocks, batched = blocks_with(max(length, 1), seqs)
    return KvCapacity(
        device=device.value,
        device_hbm_bytes=DEVICE_HBM_BYTES[device],
        assumed_hbm_bytes=fd.assumed_hbm_bytes,
        budget_bytes=int(fd.budget()),
        weight_bytes=weight_bytes,
        profile_kv_bytes=fd.profile_blocks(batched, seqs) * block_bytes,
        block_size=fd.block_size,
        block_bytes=block_bytes,
        blocks=max(blocks, 0),
        kv_tokens=max(blocks, 0) * fd.block_size,
        max_model_len=max(length, 0),
        max_num_seqs=seqs if fits else 0,
        max_num_batched_tokens=batched,
        fits=fits,
        problem="" if fits else _problem(fd, weight_bytes, blocks, length, block_bytes),
    )


def _problem(fd: FastDeployMemory, weight_bytes: int, blocks: int, length: int, block_bytes: int) -> str:
    """Why FastDeploy cannot serve this rank so, in a line."""
    if blocks <= 0:
        return (
            f"the weights take {weight_bytes / GIB:.2f} GiB of the {fd.budget() / GIB:.2f} GiB FastDeploy's HPU worker "
            f"sizes for ({fd.assumed_hbm_bytes / GIB:.0f} GiB x {fd.gpu_memory_utilization} - "
            f"{fd.reserved_bytes / MIB:.0f} MiB), leaving no KV-cache block of {block_bytes / MIB:.2f} MiB"
        )
    if length < fd.min_max_model_len:
        return f"--max-model-len {length} is below FastDeploy's least, {fd.min_max_model_len}"
    return (
        f"{blocks} KV-cache blocks of {fd.block_size} tokens are left after the weights; a sequence of {length} "
        f"tokens needs {length // fd.block_size + fd.enc_dec_block_num}"
    )
