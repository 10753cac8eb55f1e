"""Make tests/data/gguf_llama/vision/: a tiny multimodal Qwen3.5 checkpoint (`tests/tiny_vision.py`: a random
`Qwen3_5ForConditionalGeneration` saved by transformers, with the vision tokenizer) and the GGUF files llama.cpp's own
converter writes of it: the text model (f32, `--no-mtp`) and the multimodal projector (`--mmproj`) in f32, f16 and
q8_0. deltaspec's tests read the projector files and compare their tower and the GGUF model's image answers with the
checkpoint's own (`tests/test_vision_mmproj.py`).

    .venv/bin/python tools/make_mmproj_fixtures.py /path/to/llama.cpp
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_vision import write_multimodal, write_vision_tokenizer  # noqa: E402
from tools.make_gguf_fixtures import convert, give_qwen_pre_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "data" / "gguf_llama" / "vision"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json")
PROJECTOR_TYPES = ("f32", "f16", "q8_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    llama_cpp = args.llama_cpp.resolve()
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{llama_cpp} has no convert_hf_to_gguf.py; pass the llama.cpp source directory.")
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "checkpoint").mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_multimodal(Path(tmp) / "qwen35-vision", seed=0)
        write_vision_tokenizer(hf_dir)
        give_qwen_pre_tokenizer(hf_dir, "qwen35")
        convert(llama_cpp, hf_dir, "qwen35", out / "text-f32.gguf", "f32", "--no-mtp")
        for outtype in PROJECTOR_TYPES:
            convert(llama_cpp, hf_dir, "qwen35", out / f"mmproj-{outtype}.gguf", outtype, "--mmproj")
        for name in (*CHECKPOINT_FILES, "tokenizer_config.json"):
            shutil.copy(hf_dir / name, out / "checkpoint" / name)
    print(f"wrote {sorted(p.name for p in out.rglob('*') if p.is_file())}")


if __name__ == "__main__":
    main()
