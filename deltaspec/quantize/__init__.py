"""`deltaspec quantize`: a float checkpoint -> a GGUF file for llama.cpp (and deltaspec). Modules: `imatrix` (the
importance of each projection's inputs, measured on calibration text through the engine), `command` (the command:
checks, calibration, writing with `deltaspec.model.gguf_write`, the summary)."""
