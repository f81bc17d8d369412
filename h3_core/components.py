"""The four components of an H3 model, in the order a generation uses them (its phases)."""

COMPONENTS = ("text_encoder", "transformer", "video_vae", "audio_vae")
