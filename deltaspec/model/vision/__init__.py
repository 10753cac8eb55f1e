"""The vision tower of the multimodal Qwen3.5 checkpoints and what feeds it: the checkpoint's image processing
(`preprocess`), the tower (`config`, `grid`, `tower`, `load`) and the text model's three position streams for a
prompt with images (`rope_index`)."""
