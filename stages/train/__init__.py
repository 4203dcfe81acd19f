"""Stage 3, train: a LoRA on the cached latents and captions, loading only the denoiser.

    lorapipe train <run> [--resume | --restart]

stage.py is the stage (its fingerprint, staleness, upstream check and `run`), trainer.py the training
loop, checkpoints.py the checkpoints it saves and resumes from. The stage's names are this package's,
so `from stages import train; train.run(cfg)` reads as for any other stage.
"""

from stages.train.stage import (NAME, artifact_dir, check_upstream,  # noqa: F401
                                describe_change, fingerprint_parts, other_settings, partial_state,
                                refuse_unfinished, request_stop, run, stop_file, trained_with, up_to_date)
