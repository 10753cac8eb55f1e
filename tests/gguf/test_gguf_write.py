"""`deltaspec quantize` (`deltaspec.model.gguf_write`): GGUF files byte for byte as llama.cpp's converter and
llama-quantize write them (tests/data/gguf_write/oracles.json.gz, tools/make_gguf_write_oracles.py), read back
exactly, loaded and run by deltaspec, the importance measured as llama-imatrix measures it; user errors as one
line."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

from deltaspec.cli import main
from deltaspec.errors import DeltaspecError
from deltaspec.evaluate_kl import kl_divergence
from deltaspec.llm import LLM
from deltaspec.model.gguf_file import read_gguf
from deltaspec.model.gguf_write import FILE_TYPES, Importance, write_gguf
from deltaspec.model.gguf_write_names import gguf_importance, layout_for
from deltaspec.model.gguf_write_source import open_source
from deltaspec.model.hf_config import parse_model_config
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.quantize.imatrix import collect_importance
from deltaspec.sample.params import SamplingParams
from tools.make_gguf_write_oracles import CALIBRATION, IMATRIX_TYPES, WINDOW, WINDOWS, synthetic_importance, write_case

DATA = Path(__file__).parents[1] / "data"
ORACLES = json.loads(gzip.decompress((DATA / "gguf_write" / "oracles.json.gz").read_bytes()))["cases"]
FIXTURE_FILES = sorted(p for p in (DATA / "gguf").glob("*.gguf") if "-split-" not in p.name)  # the converter's
QUICK = ("qwen35", "qwen35moe", "qwen3next", "qwen35moe-256")
CONVERTER_TYPES = ("F16", "BF16", "Q8_0")
ALL_TYPES = [t for t in FILE_TYPES if t != "F32"]
ORACLE_RUNS = (  # (case, --type, oracle); the IQ4 types' searches are slow on the default model's tensors
    [(case, t, t) for case in QUICK for t in ALL_TYPES if t not in ("F16", "BF16")]
    + [(case, t, f"converter-{t.lower()}") for case in ORACLES for t in CONVERTER_TYPES]
    + [("qwen35moe-256", t, f"imatrix-{t}") for t in IMATRIX_TYPES]
    + [("default", t, f"imatrix-{t}") for t in ("Q4_K_M", "Q2_K", "Q5_1")]
    + [("default", t, t) for t in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q2_K", "Q3_K", "Q4_0", "Q4_1")]
)
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def sum_of_squares(values: list[float]) -> float:\n    return sum(v * v for v in values)\n",
    "<|im_start|>user\nWhat time is it in Tokyo?<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    "Numbers 0 1 42 3.14 -1e-6, I'VE and he'll've.\n\n\t  trailing   ",
]
HELDOUT = (DATA / "heldout_code_sample.txt").read_text()
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
# the converter stores these +1 (RMSNorm weights) or as -exp(A_log)
VALUE_CHANGED = re.compile(r"(?<!linear_attn\.)norm(_embedding|_hidden)?\.weight$|\.A_log$")
ONE_ULP = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the quantizers' many small ops slow down badly when a second core is busy elsewhere."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


GGUF_SAMPLING_KEYS = {  # generation_config.json key -> the GGUF key llama.cpp's converter writes it as
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}
DELTASPEC_ONLY = ("do_sample", "max_new_tokens")  # generation defaults the converter drops and deltaspec writes


def as_the_oracle_saw_it(hf_dir: Path, root: Path) -> Path:
    """A copy of the embedded model (same directory name) whose generation_config.json holds no sampling default
    the oracle's file lacks: neither what deltaspec writes beyond the converter
    (test_generation_defaults_the_converter_drops_travel_too) nor what was added after the oracles were made."""
    recorded = ORACLES["default"]["metadata"]
    copy = shutil.copytree(hf_dir, root / "as-converted" / hf_dir.name)
    generation = json.loads((copy / "generation_config.json").read_text())
    dropped = set(DELTASPEC_ONLY) | {key for key, gguf_key in GGUF_SAMPLING_KEYS.items() if gguf_key not in recorded}
    kept = {key: value for key, value in generation.items() if key not in dropped}
    (copy / "generation_config.json").write_text(json.dumps(kept))
    return copy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each oracle case's Hugging Face checkpoint (for "default", the embedded model's, as the oracle saw it)."""
    root = tmp_path_factory.mktemp("gguf_write_hf")
    cases = {case: write_case(root, case)[0] for case in ORACLES}
    return cases | {"default": as_the_oracle_saw_it(cases["default"], root)}


def written(checkpoints, tmp_path, case: str, kind: str, importance: Importance | None = None) -> Path:
    path = tmp_path / f"{case}-{kind}.gguf"
    write_gguf(open_source(str(checkpoints[case])), path, kind, importance, progress=False)
    return path


def sha8(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


def tensor_digests(path: Path) -> tuple[list[str], dict]:
    """The tensor names in file order, and {name: "TYPE:ne0xne1...:sha8"} with general.file_type and the whole
    file's digest ("file"), as the oracle tool keeps them."""
    reader = gguf.GGUFReader(path)
    digests = {
        t.name: f"{t.tensor_type.name}:{'x'.join(map(str, t.shape.tolist()))}:{sha8(t.data.tobytes())}"
        for t in reader.tensors
    }
    digests["general.file_type"] = int(reader.fields["general.file_type"].contents())
    digests["file"] = sha8(path.read_bytes())
    return [t.name for t in reader.tensors], digests


def tensor_bytes(path: Path) -> dict[str, tuple[str, str]]:
    """{name: (ggml type, sha8 of its bytes)}, whatever the order and the stored shape."""
    return {t.name: (t.tensor_type.name, sha8(t.data.tobytes())) for t in gguf.GGUFReader(path).tensors}


def stored_order(want: dict) -> list[str]:
    """The tensor names of an oracle's file, in its order."""
    return [name for name in want if name not in ("general.file_type", "file")]


def synthetic(path: Path) -> Importance:
    """The oracle tool's seeded importance for the tensors of the file at `path`."""
    shapes = [(t.name, tuple(int(n) for n in reversed(t.shape.tolist()))) for t in gguf.GGUFReader(path).tensors]
    values = {name: torch.from_numpy(v) for name, v in synthetic_importance(shapes).items()}
    return Importance(values, "synthetic", 1)


@pytest.mark.parametrize("fixture", FIXTURE_FILES, ids=lambda p: p.stem)
def test_files_equal_the_converters_byte_for_byte(fixture, checkpoints, tmp_path):
    """The converter's float files byte for byte. Its q8_0 holds the bytes llama-quantize's Q8_0 preset gives each
    tensor, which deltaspec writes in llama-quantize's order and shapes (the file llama-quantize would write)."""
    family, outtype = fixture.stem.rsplit("-", 1)
    mine = written(checkpoints, tmp_path, family, outtype.upper())
    if outtype.upper() in ("F32", "F16", "BF16"):
        assert mine.read_bytes() == fixture.read_bytes()
    else:
        assert tensor_bytes(mine) == tensor_bytes(fixture)


def test_default_model_f32_file_equals_the_converters(checkpoints, tmp_path):
    path = written(checkpoints, tmp_path, "default", "F32")
    names, digests = tensor_digests(path)
    assert names == ORACLES["default"]["tensors"] == stored_order(ORACLES["default"]["converter-f32"])
    assert digests == ORACLES["default"]["converter-f32"]
    reader = gguf.GGUFReader(path)
    keys = [key for key in reader.fields if not key.startswith("GGUF.")]
    assert keys == list(ORACLES["default"]["metadata"])


@pytest.mark.parametrize(("case", "kind", "oracle"), ORACLE_RUNS, ids=lambda v: str(v))
def test_tensors_equal_llama_quantize(case, kind, oracle, checkpoints, tmp_path):
    """Names, order, ggml types, shapes and bytes of every tensor as llama.cpp writes them, and the whole file but
    for imatrix runs (llama-quantize names its imatrix file in `quantize.imatrix.file`; deltaspec measures the
    importance itself)."""
    importance = None
    if oracle.startswith("imatrix-"):
        importance = synthetic(written(checkpoints, tmp_path, case, "F32"))
    names, digests = tensor_digests(written(checkpoints, tmp_path, case, kind, importance))
    want = ORACLES[case][oracle]
    if oracle == "converter-q8_0":  # the converter's own order and shapes: only types and bytes are the same
        digests, want = ({n: d.split(":")[::2] for n, d in x.items() if n not in ("file", "general.file_type")}
                         for x in (digests, want))  # fmt: skip
        assert digests == want
        return
    assert names == stored_order(want)
    assert {n: d for n, d in digests.items() if d != want.get(n) and n != "file"} == {}
    assert digests.keys() == want.keys()
    if importance is None:
        assert digests["file"] == want["file"]


@pytest.mark.parametrize("case", ["qwen35", "qwen35moe", "qwen3next"])
def test_f32_round_trip(case, checkpoints, tmp_path):
    """read_gguf of the f32 file gives the checkpoint's config, its tokenizer, and every tensor: exactly, but for
    the norms and A_log, which the file holds as float32(w + 1) and float32(-exp(A_log)) (exactly that), so that
    reading them back is within one float32 step of 1."""
    hf_dir = checkpoints[case]
    path = written(checkpoints, tmp_path, case, "F32")
    checkpoint = read_gguf(path, grouped_qkvz=True)  # Hugging Face's names, Qwen3-Next's projections grouped
    assert parse_model_config(checkpoint.config) == parse_model_config(json.loads((hf_dir / "config.json").read_text()))
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    source, experts = load_file(hf_dir / "model.safetensors"), {}
    for name, value in sorted(source.items()):
        if match := EXPERT.match(name):  # per expert: stacked as read_gguf stacks them
            experts.setdefault(f"{match[1]}.{match[3]}", []).append(value)
            continue
        want = (value.squeeze(1) if name.endswith("conv1d.weight") else value).numpy()
        got = checkpoint.tensors[name].data
        if VALUE_CHANGED.search(name):
            np.testing.assert_allclose(got, want, rtol=0, atol=ONE_ULP, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    for name, parts in experts.items():
        np.testing.assert_array_equal(checkpoint.tensors[name].data, torch.stack(parts).numpy(), err_msg=name)
    assert len(checkpoint.tensors) == len(source) - sum(len(p) for p in experts.values()) + len(experts)
    assert np.array_equal(stored["output_norm.weight"], (source["model.norm.weight"] + 1).numpy())
    if case == "qwen3next":  # no value-head reorder
        a_log = next(name for name in source if name.endswith(".A_log"))
        assert np.array_equal(stored[f"blk.{a_log.split('.')[2]}.ssm_a"], (-torch.exp(source[a_log])).numpy())
    reference = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in TEXTS:
        assert checkpoint.tokenizer.encode(text) == reference.encode(text).ids


def test_default_model_tokenizer_round_trips(tmp_path):
    path = tmp_path / "default-q8_0.gguf"
    assert main(["quantize", str(path), "--type", "q8_0", "--device", "cpu"]) == 0
    checkpoint = read_gguf(path)
    reference = Tokenizer.from_dir(open_source(None).path)
    for text in [*TEXTS, HELDOUT[:2000]]:
        assert checkpoint.tokenizer.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert checkpoint.tokenizer.apply_chat_template(messages) == reference.apply_chat_template(messages)


@pytest.mark.parametrize("case", ["qwen35", "qwen35moe-256"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_quantized_files_load_and_generate(case, kind, checkpoints, tmp_path):
    path = written(checkpoints, tmp_path, case, kind)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.fixture(scope="module")
def default_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_write_default")
    source = open_source(None)
    files = {kind: root / f"default-{kind}.gguf" for kind in ("Q8_0", "Q4_K_M")}
    for kind, path in files.items():
        write_gguf(source, path, kind, progress=False)
    return files


def test_kl_of_q8_0_is_small_and_below_q4_k_m(default_files):
    base = LLM(None, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=257)
    kl = {}
    for kind, path in default_files.items():
        model = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=257)
        kl[kind] = kl_divergence(model, HELDOUT, window=256, max_windows=3, base=base)
    assert kl["Q8_0"]["kl"]["mean"] < 2e-3 and kl["Q8_0"]["top1_agreement"] > 0.97
    assert kl["Q8_0"]["kl"]["mean"] < kl["Q4_K_M"]["kl"]["mean"] < 0.05


def test_importance_equals_llama_imatrix_on_the_same_windows():
    """deltaspec's collection on the default model (float32) against llama-imatrix's (stored as float16)."""
    llm = LLM(None, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=WINDOW + 1)
    source = open_source(None)
    means, windows = collect_importance(llm, CALIBRATION.read_text(), WINDOW, WINDOWS, progress=False)
    assert windows == WINDOWS
    layout = layout_for(source.config, source.arch)
    mine = dict(pair for name, mean in means.items() for pair in gguf_importance(name, mean, layout))
    theirs = np.load(DATA / "gguf_write" / "imatrix-default.npz")
    assert sorted(mine) == sorted(theirs.files)
    for name in theirs.files:
        np.testing.assert_allclose(mine[name].numpy(), theirs[name].astype(np.float32), rtol=3e-3, err_msg=name)


def test_importance_of_the_shared_expert_is_what_every_token_gave_it(checkpoints):
    """The shared expert is multiplied inside the experts op, not by a module call: its gate and up still get
    the mean squared layer input, its down the mean squared `silu(gate) * up`, over every token; so do the
    router and the shared expert's gate, which the router op multiplies."""
    llm = LLM(str(checkpoints["qwen35moe-256"]), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=65)
    moe = llm.engine.model.model.layers[0].mlp
    inputs = []
    handle = moe.register_forward_pre_hook(lambda _module, args: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        means, _ = collect_importance(llm, CALIBRATION.read_text(), 64, 2, progress=False)
    finally:
        handle.remove()
    x = torch.cat(inputs).double()  # [tokens, H]
    gate, up = (x @ moe.shared_expert.gate_up_proj.weight.double().T).chunk(2, dim=-1)
    for router_part in ("gate", "shared_expert_gate"):
        got = means[f"model.layers.0.mlp.{router_part}.weight"].double()
        torch.testing.assert_close(got, x.square().mean(0), rtol=1e-5, atol=0)
    name = "model.layers.0.mlp.shared_expert"
    for part in ("gate_proj", "up_proj"):
        torch.testing.assert_close(means[f"{name}.{part}.weight"].double(), x.square().mean(0), rtol=1e-5, atol=0)
    down_input = torch.nn.functional.silu(gate) * up  # [tokens, I]
    want = down_input.square().mean(0)
    torch.testing.assert_close(means[f"{name}.down_proj.weight"].double(), want, rtol=1e-4, atol=0)


def test_cli_quantizes_a_moe_model_with_calibration(checkpoints, tmp_path, capsys):
    path = tmp_path / "moe-q4_k_m.gguf"
    args = ["quantize", str(checkpoints["qwen35moe-256"]), str(path), "--type", "q4_k_m", "--device", "cpu"]
    calibration = ["--calibration", str(CALIBRATION), "--window", "64", "--calibration-windows", "3"]
    assert main([*args, *calibration]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path} (q4_k_m)" in out and "Q4_K" in out and "importance:" in out and "3 windows" in out
    fields = gguf.GGUFReader(path).fields
    assert fields["quantize.imatrix.chunks_count"].contents() == 3
    assert fields["quantize.imatrix.dataset"].contents() == "calibration.txt"
    plain = written(checkpoints, tmp_path, "qwen35moe-256", "Q4_K_M")
    with_imatrix, without = tensor_digests(path)[1], tensor_digests(plain)[1]
    changed = {name for name in without if without[name] != with_imatrix[name]}
    assert "blk.0.ffn_gate_exps.weight" in changed and "blk.0.attn_qkv.weight" in changed
    assert {"blk.0.ffn_gate_shexp.weight", "blk.0.ffn_up_shexp.weight"} <= changed  # the shared expert's own
    assert not any(name.startswith(("token_embd", "output.")) for name in changed)  # no importance, as llama.cpp
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    assert llm.generate(["x = 1"], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids


def test_a_float_gguf_file_is_quantized_like_its_checkpoint(tmp_path):
    """The f32 file's matrices are the checkpoint's: quantized alike. Its norms and A_log, read back (-1, log)
    and converted again (+1, -exp), may move in the last bit."""
    from_gguf = tmp_path / "from-gguf.gguf"
    assert main(["quantize", str(DATA / "gguf" / "qwen35-f32.gguf"), str(from_gguf), "--type", "q4_0"]) == 0
    names, digests = tensor_digests(from_gguf)
    want = ORACLES["qwen35"]["Q4_0"]
    assert names == stored_order(want)
    assert {n: d.split(":")[0] for n, d in digests.items() if n in names} == {n: want[n].split(":")[0] for n in names}
    assert {n for n in names if digests[n] != want[n]} <= {n for n in names if want[n].startswith("F32")}
    assert digests["general.file_type"] == want["general.file_type"]


def test_the_sampling_defaults_travel_in_the_file(checkpoints, tmp_path):
    """As llama.cpp's converter does, the checkpoint's generation_config.json becomes `general.sampling.*`
    (temperature, top_p, top_k), quantizing a float GGUF keeps them, and a loaded GGUF takes them
    as its sampling defaults."""
    model = tmp_path / "model"
    shutil.copytree(checkpoints["qwen35"], model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    first, again = tmp_path / "first.gguf", tmp_path / "again.gguf"
    assert main(["quantize", str(model), str(first), "--type", "bf16"]) == 0
    assert main(["quantize", str(first), str(again), "--type", "q4_0"]) == 0
    for path in (first, again):
        fields = gguf.GGUFReader(path).fields
        assert fields["general.sampling.top_k"].types == [gguf.GGUFValueType.INT32]
        llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
        params = llm.get_default_sampling_params()
        assert params.temperature == pytest.approx(0.6) and params.top_p == pytest.approx(0.95)
        assert params.top_k == 20 and params.min_p == 0.0


@pytest.mark.parametrize("greedy", [{"do_sample": False}, {"do_sample": False, "temperature": 0.7}, {"temperature": 0}])
def test_generation_defaults_the_converter_drops_travel_too(greedy, checkpoints, tmp_path):
    """A greedy checkpoint (`do_sample: false`, which llama.cpp's converter drops, or temperature 0) gives a file
    whose `general.sampling.temp` is 0, where the converter writes it (llama.cpp samples greedily at 0 too),
    `repetition_penalty` travels as `general.sampling.penalty_repeat` (as llama.cpp's own gguf-py writes it) and
    `max_new_tokens` as `deltaspec.sampling.max_tokens`: deltaspec loads the file, and the file quantized again,
    with the checkpoint's sampling defaults."""
    model = tmp_path / "model"
    shutil.copytree(checkpoints["qwen35"], model)
    defaults = {"top_p": 0.5, "repetition_penalty": 1.25, "max_new_tokens": 33}
    (model / "generation_config.json").write_text(json.dumps(greedy | defaults))
    first, again = tmp_path / "first.gguf", tmp_path / "again.gguf"
    assert main(["quantize", str(model), str(first), "--type", "f32"]) == 0
    assert main(["quantize", str(first), str(again), "--type", "q8_0"]) == 0
    from_checkpoint = LLM(str(model), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    want = from_checkpoint.get_default_sampling_params()
    assert (want.temperature, want.repetition_penalty, want.max_tokens) == (0.0, 1.25, 33)
    for path in (first, again):
        fields = gguf.GGUFReader(path).fields
        assert [key for key in fields if "sampling" in key] == [
            "general.sampling.top_p",
            "general.sampling.temp",
            "general.sampling.penalty_repeat",
            "deltaspec.sampling.max_tokens",
        ]
        assert fields["general.sampling.temp"].contents() == 0.0
        assert fields["general.sampling.temp"].types == [gguf.GGUFValueType.FLOAT32]
        llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
        assert llm.get_default_sampling_params() == want


def test_gguf_sampling_keys_map_to_sampling_params():
    from deltaspec.model.generation_config import gguf_sampling_defaults

    metadata = {"general.sampling.temp": 0.7, "general.sampling.top_k": -1, "general.sampling.penalty_repeat": 1.1}
    assert gguf_sampling_defaults(Path("m.gguf"), metadata) == {
        "temperature": 0.7,
        "top_k": 0,
        "repetition_penalty": 1.1,
    }
    with pytest.raises(DeltaspecError, match="m.gguf sets general.sampling.top_p to 'x'"):
        gguf_sampling_defaults(Path("m.gguf"), {"general.sampling.top_p": "x"})


def quantize_error(capsys, *args: str) -> str:
    """The one `error: ...` line of a `deltaspec quantize` that exits 2."""
    assert main(["quantize", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith("."), err
    return errors[0]


def test_user_errors_are_one_sentence(capsys, checkpoints, tmp_path):
    out = str(tmp_path / "out.gguf")
    assert "Unknown --type 'q4_k_z'" in quantize_error(capsys, out, "--type", "q4_k_z")
    assert "uses no importance matrix" in quantize_error(capsys, out, "--type", "q8_0", "--calibration", out)
    assert "Unknown device 'tpu'" in quantize_error(capsys, out, "--type", "q8_0", "--device", "tpu")
    assert "Cannot write the GGUF file" in quantize_error(
        capsys, str(tmp_path / "missing" / "out.gguf"), "--type", "q8_0"
    )
    assert "Cannot write the GGUF file" in quantize_error(capsys, str(tmp_path), "--type", "q8_0")
    message = quantize_error(capsys, str(DATA / "gguf" / "qwen35-q8_0.gguf"), out, "--type", "q4_k_m")
    assert "holds Q8_0 tensors" in message
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    config = json.loads((checkpoints["qwen35"] / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    assert "is a quantized checkpoint" in quantize_error(capsys, str(quantized), out, "--type", "q8_0")
    assert "less than one window" in quantize_error(
        capsys, out, "--type", "q4_k_m", "--calibration", str(CALIBRATION), "--window", "4000", "--device", "cpu"
    )
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.partial").exists()


def test_a_tokenizer_llama_cpp_would_split_differently_is_refused(capsys, checkpoints, tmp_path):
    other = tmp_path / "gpt2-split"
    other.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (other / name).write_text((checkpoints["qwen35"] / name).read_text())
    save_file(load_file(checkpoints["qwen35"] / "model.safetensors"), other / "model.safetensors")
    tokenizer = json.loads((checkpoints["qwen35"] / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    message = quantize_error(capsys, str(other), str(tmp_path / "out.gguf"), "--type", "q8_0")
    assert "neither Qwen2's nor Qwen3.5's" in message
