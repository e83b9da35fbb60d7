"""Layer-major runs: every window through layer L before layer L+1 is read. The same amax, expert counts and
logits as the batch-major forward, to the bit; each layer read once whatever the number of windows; hidden states
in a scratch file that never outlives the run; progress against a known total."""

from __future__ import annotations

import io
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from hpu_fp8_loader import console
from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.engine.fp8 import EmulationOptions, Fp8Emulator, Fp8Parameters
from hpu_fp8_loader.engine.layer_major import LayerProgress, blas_threads, layer_steps, run_layer_major
from hpu_fp8_loader.engine.model import EngineConfig, ReferenceModel, forward
from hpu_fp8_loader.engine.weights import ROUTER, EngineWeights, open_weights, part_of
from hpu_fp8_loader.errors import NonFiniteError, WriteFailedError
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, map_rank
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.datasets import dataset_tokens, token_batches
from hpu_fp8_loader.quality.evaluate import evaluate
from hpu_fp8_loader.quality.observers import AmaxObserver
from hpu_fp8_loader.quality.report import Report
from hpu_fp8_loader.sources.synth import preset_config, synthesize
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import parse_quantization_config

SAMPLES, SEQ_LEN, BATCH = 6, 32, 4  # two chunks, the second short: 4 + 2 windows


def batch_major(model, samples: int, all_experts: bool) -> AmaxObserver:
    """What calibrate computed before it ran layer-major: ``forward`` batch by batch, one observer throughout."""
    weights = open_weights(model)
    observer = AmaxObserver(weights.descriptor.prefix, all_experts)
    ids = dataset_tokens(model, weights.descriptor.vocab_size).ids
    for batch in token_batches(ids, samples, SEQ_LEN, BATCH):
        forward(weights, batch, observer)
    return observer


CASES = [(name, False) for name in TINY_MODELS] + [("ernie-moe-tiny", True)]


@pytest.mark.parametrize(("model", "all_experts"), CASES, ids=[f"{m}{'-all-experts' if a else ''}" for m, a in CASES])
@pytest.mark.usefixtures("one_blas_thread")
def test_layer_major_calibration_equals_batch_major_to_the_bit(source_factory, model, all_experts):
    root = TINY_MODELS[model] if model in TINY_MODELS else source_factory(model)
    expected = batch_major(root, SAMPLES, all_experts)
    result = calibrate(root, samples=SAMPLES, seq_len=SEQ_LEN, batch_size=BATCH, all_experts=all_experts)
    assert list(result.measurements.amax.items()) == list(expected.amax.items())  # same values, same order
    assert result.measurements.expert_tokens == expected.expert_tokens
    assert result.tokens == SAMPLES * SEQ_LEN


def test_the_amax_order_is_the_models_whatever_the_chunks(tmp_path):
    """Each point enters the measurements when its stage first sees it, and an expert's stage runs every chunk
    before the next expert's: the file's order is layer by layer, experts in number order, whatever the batch size
    (a window at a time, every expert cannot have been routed tokens in the first chunk)."""
    root = tmp_path / "sixteen-experts"
    synthesize(root, preset_config("ernie-moe-tiny", {"moe_num_experts": 16, "moe_k": 2}), "paddle", seed=3)
    orders = [list(calibrate(root, samples=6, seq_len=16, batch_size=b).measurements.amax) for b in (1, 4, 6)]
    assert orders[0] == orders[1] == orders[2]
    experts = [names.expert_of(key) for key in orders[0] if names.expert_of(key) is not None]
    assert experts == sorted(experts) and len(experts) > 16


class CountingWeights(EngineWeights):
    """The real weights, counting how often each part of a layer and each block of the embedding is read from
    the checkpoint, read-ahead included (never cached)."""

    def __init__(self, root):
        opened = open_weights(root)
        super().__init__(opened.checkpoint, opened.descriptor, cache_bytes=0)
        self.reads: Counter = Counter()

    def _read(self, key):
        self.reads[key] += 1
        return super()._read(key)

    def embedding_rows(self, start, stop):
        self.reads[("embedding", start)] += 1
        return super().embedding_rows(start, stop)


class EnteredParts(AmaxObserver):
    def __init__(self, prefix: str):
        super().__init__(prefix)
        self.entered: list[tuple[int, list[str]]] = []

    def enter_weights(self, layer, weights):
        self.entered.append((layer, list(weights)))


@pytest.mark.parametrize("windows", [1, 3, 8])
def test_each_part_is_read_once_whatever_the_number_of_windows(source_factory, monkeypatch, windows):
    """Every part of every layer (attention, MLP or router, each expert) and every block of the embedding is read
    once, and entered once, whatever the number of chunks: 3 blocks of the embedding here."""
    import hpu_fp8_loader.engine.weights as weights_module

    weights = CountingWeights(source_factory("ernie-moe-tiny"))
    d = weights.descriptor
    monkeypatch.setattr(weights_module, "EMBEDDING_BLOCK_BYTES", 4 * d.hidden_size * (d.vocab_size // 3 + 1))
    assert weights.reads_ahead  # a tiny model: the next part is read while this one runs, and still only once
    observer = EnteredParts("ernie")
    ids = np.arange(windows * 16).reshape(windows, 16) * 37 % d.vocab_size
    run_layer_major({"m": ReferenceModel(weights, observer=observer)}, ids, 2)
    parts = [(layer, part) for layer in range(d.num_layers) for part in weights.parts(layer)]
    blocks = [("embedding", start) for start, _ in weights.embedding_blocks()]
    assert len(blocks) == 3
    assert weights.reads == Counter(dict.fromkeys(parts + blocks, 1))  # no head for calibration
    # once per part, not per chunk; an MoE layer's router part once more, as its shared experts run
    again = [(layer, ROUTER) for layer in d.moe_layers()]
    entered = [(layer, next(part_of(w) for w in d.weights() if w.name == names_[0])) for layer, names_ in observer.entered]
    assert Counter(entered) == Counter(parts + again)
    assert d.moe is not None and len(weights.parts(d.moe_layers()[0])) == 2 + d.moe.num_experts
    everything = {name for _, names_ in observer.entered for name in names_}
    embedding = names.tensor(names.embedding(d.prefix), names.WEIGHT)
    assert everything == {w.name for w in d.weights() if w.layer is not None} and embedding not in everything


def test_an_moe_layer_holds_one_expert_at_a_time(source_factory):
    """As an expert's weights are entered, the experts' weights still alive are its own and at most the next
    expert's, being read ahead: never the layer's other experts (weak references to every array read)."""
    import weakref

    d = open_weights(source_factory("ernie-moe-tiny")).descriptor
    read: list[weakref.ref] = []

    class Tracked(CountingWeights):
        def _read(self, key):
            arrays = super()._read(key)
            if isinstance(key[1], int):
                read.extend(weakref.ref(array) for array in arrays.values())
            return arrays

    alive: list[int] = []

    class Watch(AmaxObserver):
        def enter_weights(self, layer, weights):
            if any(w.expert is not None for w in d.weights() if w.name in weights):
                alive.append(sum(ref() is not None for ref in read))

    weights = Tracked(source_factory("ernie-moe-tiny"))
    run_layer_major({"m": ReferenceModel(weights, observer=Watch("ernie"))}, np.arange(3 * 16).reshape(3, 16), 2)
    assert d.moe is not None and len(alive) == d.moe.num_experts * len(d.moe_layers())
    assert max(alive) <= 2 * 2  # up_gate and down of this expert and of the next one
    assert sum(ref() is not None for ref in read) <= 2  # after the run: at most the last expert's pair


class CountingParameters(Fp8Parameters):
    def __init__(self, root, tp: int):
        super().__init__(root, tp)
        self.mapped: Counter = Counter()

    def _map(self, key, par):
        self.mapped[key] += 1
        return super()._map(key, par)


def test_an_evaluation_maps_each_fp8_part_once_for_all_rows(spec_factory):
    """The rows run in lockstep, part by part, so each part of each layer (attention, MLP or router, each expert),
    the embedding and the head is mapped once per rank for both rows; the heads' logits come chunk by chunk."""
    parameters = CountingParameters(spec_factory("ernie-moe-tiny"), 2)
    base = Fp8Emulator(None, 2, parameters=parameters)
    models = {name: base.with_options(EmulationOptions(weights_only=name == "w")) for name in ("fp8", "w")}
    seen = []
    run_layer_major(models, np.arange(5 * 16).reshape(5, 16), 2, lambda part, label, x: seen.append((part, label)))
    assert parameters.mapped == Counter(dict.fromkeys(parameters.parts, 2))  # 2 ranks, every part once
    d = parameters.d
    assert d.moe is not None and sum(key[0] == d.moe_layers()[0] for key in parameters.parts) == 2 + d.moe.num_experts
    assert [(p.start, p.stop, label) for p, label in seen] == [
        (a, b, label) for a, b in ((0, 2), (2, 4), (4, 5)) for label in ("fp8", "w")
    ]


def test_the_emulation_holds_one_mapped_expert_at_a_time(spec_factory):
    """Each expert's parameters are mapped alone (stacked as ``[1, ...]``) and dropped before the next is mapped:
    after each expert's stage, no earlier expert's array is alive (weak references to every one mapped)."""
    import weakref

    mapped: list[tuple[int, weakref.ref]] = []

    class Tracked(Fp8Parameters):
        def _map(self, key, par):
            params = super()._map(key, par)
            if isinstance(key[1], int):
                assert all(a.shape[0] == 1 for n, a in params.items() if "experts" in n and "gate_correction" not in n)
                mapped.extend((key[1], weakref.ref(a)) for a in params.values())
            return params

    parameters = Tracked(spec_factory("ernie-moe-tiny"), 2)
    alive: list[set[int]] = []
    original = parameters.part

    def watching(layer, part):
        alive.append({e for e, ref in mapped if ref() is not None})
        return original(layer, part)

    parameters.part = watching
    Fp8Emulator(None, 2, parameters=parameters).forward(np.arange(2 * 16).reshape(2, 16))
    assert mapped and all(len(experts) <= 1 for experts in alive)  # at most the expert just run, being replaced


def test_one_layer_at_a_time_maps_exactly_the_whole_models_pieces(spec_factory):
    checkpoint = Checkpoint.open(spec_factory("ernie-moe-tiny"))
    qc, d, par = parse_quantization_config(checkpoint.config), describe(checkpoint.config), Parallelism(2, 1)
    whole = [(p.name, p.expert, p.array) for p in map_rank(checkpoint, qc, d, par)]
    by_layer = {}
    for w in d.weights():
        by_layer.setdefault(w.layer, []).append(w)
    pieces = [
        (p.name, p.expert, p.array) for layer in by_layer for p in map_rank(checkpoint, qc, d, par, weights=by_layer[layer])
    ]
    assert sorted(n for n, e, _ in pieces if e is None) == sorted(n for n, e, _ in whole if e is None)
    assert len(pieces) == len(whole)
    keyed = {(n, e): a for n, e, a in whole}
    for name, expert, array in pieces:
        assert array.dtype == keyed[(name, expert)].dtype and np.array_equal(array, keyed[(name, expert)], equal_nan=False)
    top = {p.name for p in map_rank(checkpoint, qc, d, par, weights=by_layer[None])}
    assert top == {"ernie.embed_tokens.embeddings.weight", "ernie.norm.weight", "lm_head.linear.weight"}


@pytest.mark.usefixtures("one_blas_thread")
def test_the_layer_major_logits_equal_the_batch_major_forward_to_the_bit(source_factory):
    weights = open_weights(source_factory("qwen2-tiny"))
    ids = np.arange(5 * 24).reshape(5, 24) * 7 % 500
    got = np.zeros((5, 24, weights.descriptor.vocab_size), np.float32)

    def keep(part, label, logits):
        got[part] = logits

    run_layer_major({"m": ReferenceModel(weights)}, ids, 2, keep)
    expected = np.concatenate([forward(weights, ids[a : a + 2]) for a in range(0, 5, 2)])
    assert np.array_equal(got, expected)


class ScratchWatcher(AmaxObserver):
    """Records, as layer 1 starts, which scratch files this process has mapped (from /proc/self/maps)."""

    def __init__(self, prefix: str, stop_at: int | None = None):
        super().__init__(prefix)
        self.mapped: list[str] = []
        self.stop_at = stop_at

    def enter_weights(self, layer, weights):
        if layer == 1 and not self.mapped:
            self.mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if ".hpu-fp8-hidden-" in line]
        if layer == self.stop_at:
            raise KeyboardInterrupt


def test_a_forced_scratch_file_gives_the_same_amax_and_leaves_nothing_behind(tmp_path, source_factory):
    root = source_factory("ernie-moe-tiny")
    weights = open_weights(root)
    config = EngineConfig.from_config(weights.checkpoint.config, weights.descriptor)
    ids = np.arange(6 * 32).reshape(6, 32) * 13 % 500
    in_memory, scratch = AmaxObserver("ernie"), ScratchWatcher("ernie")
    run_layer_major({"m": ReferenceModel(weights, config, in_memory)}, ids, 4)
    run_layer_major({"m": ReferenceModel(weights, config, scratch)}, ids, 4, scratch_dir=tmp_path, memory_bytes=0)
    # the hidden states, the normed input and the routed sum: each its own scratch file
    assert len(scratch.mapped) == ReferenceModel(weights).stores
    assert all(str(tmp_path) in line and "(deleted)" in line for line in scratch.mapped)
    assert list(scratch.amax.items()) == list(in_memory.amax.items()) and scratch.expert_tokens == in_memory.expert_tokens
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_run_leaves_no_scratch_file(tmp_path, source_factory):
    weights = open_weights(source_factory("qwen2-tiny"))
    observer = ScratchWatcher("qwen2", stop_at=1)
    with pytest.raises(KeyboardInterrupt):
        run_layer_major({"m": ReferenceModel(weights, observer=observer)}, np.ones((3, 8), int), 2, None, tmp_path, 0)
    assert observer.mapped and list(tmp_path.iterdir()) == []


def test_a_scratch_directory_that_does_not_exist_is_named(tmp_path, source_factory):
    weights = open_weights(source_factory("qwen2-tiny"))
    for memory_bytes in (0, None):  # refused before any work, whether the scratch file would be needed or not
        with pytest.raises(WriteFailedError, match=f"{tmp_path / 'gone'}: the scratch directory does not exist"):
            run_layer_major({"m": ReferenceModel(weights)}, np.ones((3, 8), int), 2, None, tmp_path / "gone", memory_bytes)


def test_calibration_progress_counts_up_to_a_known_total(source_factory):
    """A step is one chunk through one stage: a dense layer's attention and MLP, 3 chunks each."""
    seen: list[LayerProgress] = []
    calibrate(source_factory("qwen2-tiny"), samples=5, seq_len=16, batch_size=2, progress=seen.append)
    layers = seen[0].layers
    assert [p.done for p in seen] == list(range(1, 6 * layers + 1))  # 3 chunks through 2 stages of every layer
    assert {p.total for p in seen} == {6 * layers} and [p.layer for p in seen[::6]] == list(range(layers))


def test_the_cli_bar_shows_the_total_and_the_layer(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)  # where the bar draws
    monkeypatch.setattr(console, "bars_enabled", lambda quiet=False: True)  # as on a terminal
    with console.Progress("eval", unit="step") as progress:
        show = layer_steps(progress)
        show(LayerProgress(3, 12, 1, 4))
        progress._bar.refresh()
        assert progress.total == 12 and progress.done == 3 and "3/12" in out.getvalue() and "layer 2 of 4" in out.getvalue()
        show(LayerProgress(12, 12, 4, 4))
        progress._bar.refresh()
        assert progress.done == 12 and "logits" in out.getvalue()


def test_read_ahead_hands_over_the_plain_reads_to_the_bit_and_drops_what_is_not_asked_for(source_factory):
    """The next part a forward uses is read on the second thread as soon as this one is asked for; what it hands
    over is what a plain read gives; a read-ahead that is not asked for next is waited for and dropped."""
    root = source_factory("ernie-moe-tiny")
    ahead, plain = CountingWeights(root), CountingWeights(root)
    plain.reads_ahead = False
    order = [(layer, part) for layer in range(ahead.descriptor.num_layers) for part in ahead.parts(layer)]
    for key, after in zip(order, [*order[1:], None], strict=True):
        mine, theirs = ahead.part(*key), plain.part(*key)
        assert mine.keys() == theirs.keys()
        assert all(np.array_equal(mine[name], theirs[name]) for name in mine)
        if after is not None:
            assert ahead.reads[after] == 1 or ahead._ahead is not None  # under way, or already done
    assert ahead.reads == Counter(dict.fromkeys(order, 1))  # nothing after the last
    ahead.part(*order[0])  # not read ahead: read again, and the second part read ahead ...
    ahead.part(*order[2])  # ... which is not asked for: waited for and dropped, the third read plainly
    assert ahead.reads == Counter({**dict.fromkeys(order, 1), order[0]: 2, order[1]: 2, order[2]: 2})


def test_there_is_no_read_ahead_when_two_parts_do_not_fit(source_factory, monkeypatch):
    import hpu_fp8_loader.engine.weights as weights_module

    root = source_factory("ernie-moe-tiny")
    largest = 4 * CountingWeights(root).largest_part_parameters(decoder=True)
    monkeypatch.setattr(weights_module, "memory_budget", lambda: 4 * largest - 1)
    assert not CountingWeights(root).reads_ahead
    monkeypatch.setattr(weights_module, "memory_budget", lambda: 4 * largest)
    assert CountingWeights(root).reads_ahead


class ThreadsSeen(ReferenceModel):
    """The real engine, noting the thread each stage's chunk ran on and how many threads BLAS could use there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads: set[str] = set()
        self.blas: set[int] = set()

    def layer(self, index, space):
        def watched(load):
            def loader():
                stage = load()

                def run(part):
                    self.threads.add(threading.current_thread().name)
                    self.blas.update(blas_threads())
                    stage(part)

                return run

            return loader

        return [watched(load) for load in super().layer(index, space)]


def _report_rows(report) -> list:
    return [vars(stats) for stats in report.errors.linears.values()]


@pytest.mark.parametrize("model", ["ernie-moe-bytes", "qwen3-moe-bytes", "qwen2-bytes"])
@pytest.mark.usefixtures("one_blas_thread")
def test_threads_give_the_same_calibration_and_report_to_the_bit(model):
    """Chunks on 1, 2 or 3 threads at once: the same amax in the same order, expert counts and every report sum,
    because each chunk's arithmetic is its own and the observers' events arrive in chunk order."""
    results = []
    for threads in (1, 2, 3):
        report = Report()
        result = calibrate(TINY_MODELS[model], samples=7, seq_len=32, batch_size=2, report=report, threads=threads)
        results.append((list(result.measurements.amax.items()), result.measurements.expert_tokens, _report_rows(report)))
    assert results[0] == results[1] == results[2]
    assert results[0][2] and all(row["rows"] for row in results[0][2])


@pytest.mark.usefixtures("one_blas_thread")
def test_threads_give_the_same_eval_rows_to_the_bit(source_factory, spec_factory):
    source, checkpoint = source_factory("ernie-moe-tiny"), spec_factory("ernie-moe-tiny")
    rows = [evaluate(source, checkpoint, samples=9, seq_len=32, tp=2, threads=t).to_dict()["rows"] for t in (1, 2)]
    assert rows[0] == rows[1] and len(rows[0]) == 3


def test_chunks_run_on_the_pools_threads_and_alone_with_one(source_factory):
    weights = open_weights(source_factory("ernie-moe-tiny"))
    ids = np.arange(6 * 16).reshape(6, 16) % 500
    for threads, expected in ((2, {"hpu-fp8-chunk"}), (1, {threading.current_thread().name})):
        model = ThreadsSeen(weights, observer=AmaxObserver("ernie"))
        run_layer_major({"m": model}, ids, 2, threads=threads)
        assert {name.rsplit("_", 1)[0] for name in model.threads} == expected


@pytest.mark.parametrize(("limit", "expected"), [(None, {2}), (1, {1})])
def test_chunks_leave_blas_the_cores_left_and_never_more_than_the_process_allows(source_factory, monkeypatch, limit, expected):
    """On 4 cores (the affinity, stood in for) two chunk threads leave BLAS 2 threads each, unless the process
    already held it to fewer (OPENBLAS_NUM_THREADS=1, or threadpool_limits): that limit stands."""
    import hpu_fp8_loader.engine.layer_major as layer_major

    monkeypatch.setattr(layer_major, "usable_cores", lambda: 4)
    model = ThreadsSeen(open_weights(source_factory("ernie-moe-tiny")), observer=AmaxObserver("ernie"))
    with threadpool_limits(limit):
        run_layer_major({"m": model}, np.arange(4 * 16).reshape(4, 16) % 500, 2, threads=2)
    assert model.blas == expected


def test_a_failure_on_a_thread_is_named_and_leaves_no_scratch_file(tmp_path, source_factory):
    """An activation refused in the second chunk, while the first and third run beside it: one line naming the
    windows, every thread stopped, the scratch files gone."""
    weights = open_weights(source_factory("qwen2-tiny"))

    class Refusing(AmaxObserver):
        def record(self, module, values):
            if module.endswith("o_proj") and values.shape[0] == 2 and self.calls == 1:
                raise NonFiniteError(f"activation {module} holds NaN")
            self.calls += module.endswith("o_proj")
            super().record(module, values)

    observer = Refusing("qwen2")
    observer.calls = 0
    with pytest.raises(NonFiniteError, match=r"^m: windows 2\.\.3: activation qwen2\.layers\.0\.self_attn\.o_proj holds NaN$"):
        run_layer_major({"m": ReferenceModel(weights, observer=observer)}, np.ones((5, 8), int), 2, None, tmp_path, 0, threads=3)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["qwen2-tiny", "ernie-moe-tiny"])
def test_a_head_over_the_threshold_is_multiplied_in_blocks(source_factory, monkeypatch, model):
    """A head larger than HEAD_WHOLE_BYTES in float32 (here: any) is converted and multiplied a few vocabulary
    columns at a time, each block converted from the head as stored (bf16): the logits of one product within float32
    rounding."""
    import hpu_fp8_loader.engine.model as model_module

    weights = open_weights(source_factory(model))
    ids = np.arange(2 * 16).reshape(2, 16) % weights.descriptor.vocab_size
    whole = forward(weights, ids)
    monkeypatch.setattr(model_module, "HEAD_WHOLE_BYTES", 0)
    monkeypatch.setattr(model_module, "HEAD_BLOCK_BYTES", 4 * weights.descriptor.hidden_size * 100)  # 100 columns
    head = weights.part(None, "head")
    assert {a.dtype.name for a in head.values()} == {"bfloat16"}  # kept as stored
    blocked = forward(weights, ids)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-5)
    assert blocked.shape == whole.shape and np.isfinite(blocked).all()
