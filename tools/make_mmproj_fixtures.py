"""Make tests/data/gguf_llama/vision/: a tiny multimodal Qwen3.5 checkpoint (`tests/tiny_vision.py`: a random
`Qwen3_5ForConditionalGeneration` saved by transformers, with the vision tokenizer) and the GGUF files llama.cpp's own
converter writes of it: the text model (f32, `--no-mtp`) and the multimodal projector (`--mmproj`) in f32, f16 and
q8_0. deltaspec's tests read the projector files and compare their tower and the GGUF model's image answers with the
checkpoint's own (`tests/vision/test_vision_mmproj.py`).

    .venv/bin/python tools/make_mmproj_fixtures.py /path/to/llama.cpp
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_vision import write_multimodal, write_vision_tokenizer  # noqa: E402
from tools.make_gguf_fixtures import convert, converter_arguments, give_qwen_pre_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "data" / "gguf_llama" / "vision"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json")
PROJECTOR_TYPES = ("f32", "f16", "q8_0")


def main() -> None:
    llama_cpp, out = converter_arguments(__doc__.splitlines()[0], OUT)
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
