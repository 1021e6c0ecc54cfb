"""Images in: each family's vision tower and projector turn an image into embeddings the language model reads at its
image placeholder tokens (llmd.engine: ScheduledSeq's image spans; llmd.model.attention.AttentionMetadata.input_embeds).

A family's `VisionEncoder` (one per image-text checkpoint, built by `load_vision`) says:
- how many placeholder tokens an image takes and how a rendered prompt is expanded around them (`expand`), as the
  family's own processor does;
- how an image becomes pixel values (`preprocess`: resize, rescale, normalise, as the family's image processor);
- how pixel values become embeddings [tokens, text hidden] (`encode`: the tower, then the projector).
Images are decoded and bounded by llmd.model.vision.images before any of this.
"""
