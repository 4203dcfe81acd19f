"""Code that several families share: family classes, full-size and tiny architectures, checkpoint layouts.

A module here imports stages.core, stages.tiny and the shared family modules, never a family folder."""
