"""Code that several families share (their checkpoint layouts outside diffusers); no family module here."""
