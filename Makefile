# make demo | make test | make encode-captions CONFIG=configs/flux-dev.toml | make train RUN=my-lora (docs/configuration.md, "Using make")
PY      ?= .venv/bin/python
CONFIG  ?= configs/demo.toml
FAMILY  ?= flux
ARGS    ?=
RUN     ?=
ARTIFACTS ?= artifacts

# How a target names its run: RUN=<name> alone reads artifacts/<name>/config.json; CONFIG=<preset>
# (with RUN, renamed) otherwise. The default CONFIG (the demo) applies only when neither is given;
# ARTIFACTS overrides the preset's `artifacts` only when given.
RUN_ARGS = $(if $(and $(RUN),$(filter file,$(origin CONFIG))),$(RUN),--config $(CONFIG) $(RUN)) \
           $(if $(filter file,$(origin ARTIFACTS)),,--artifacts $(ARTIFACTS))

.PHONY: demo test venv encode-captions cache-latents train export-lora run status stop clean-latents clean-captions clean-lora
.PHONY: sample inspect report clean-samples docs-images

venv: .venv/.installed

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==2.13.0
# (PYTHONWARNINGS: setuptools' editable-install banner is not ours to show; errors still print)
	PYTHONWARNINGS=ignore .venv/bin/pip install -q -e '.[test]'
	touch $@

demo: venv
	$(PY) pipeline.py demo --family $(FAMILY)

test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile tests

run: venv
	$(PY) pipeline.py run $(RUN_ARGS) $(ARGS)

# One target per stage; a target depends on the stages it follows in stages/registry.py
# (tests/core/test_registry.py holds the two together). Freshness comes from the manifests
# (content fingerprints of inputs, config keys, model and schema), not from file times: every target
# is phony and `pipeline.py run --only <stage>` skips a stage whose manifest matches. So `make train`
# re-encodes only changed captions/images, then trains only if anything it depends on changed.
encode-captions cache-latents: venv
	$(PY) pipeline.py run $(RUN_ARGS) --only $@ $(ARGS)

train: encode-captions cache-latents
	$(PY) pipeline.py run $(RUN_ARGS) --only $@ $(ARGS)

export-lora: train
	$(PY) pipeline.py run $(RUN_ARGS) --only $@ $(ARGS)

status: venv
	$(PY) pipeline.py status $(RUN_ARGS) $(ARGS)

# make stop RUN=<run> [ARGS=--no-save]: stops whatever stage of the run is running
stop: venv
	$(if $(RUN),,$(error set RUN=<run name>, e.g. make stop RUN=demo))
	$(PY) pipeline.py stop $(RUN) --artifacts $(ARTIFACTS) $(ARGS)

# make sample CONFIG=...: base vs LoRA grid (artifacts/<run>/samples/grid.png), skipped when up to date
sample: export-lora
	$(PY) pipeline.py run $(RUN_ARGS) --only $@ $(ARGS)

# make inspect RUN=<run> [ARGS=--json | ARGS="--decode <item> --variant 1"]: offline artifact report
inspect: venv
	$(if $(RUN),,$(error set RUN=<run name>, e.g. make inspect RUN=demo))
	$(PY) pipeline.py inspect $(RUN) --artifacts $(ARTIFACTS) $(ARGS)

# make report RUN=<run>: loss / LR / samples-per-second plot (artifacts/<run>/report.png) + summary
report: venv
	$(if $(RUN),,$(error set RUN=<run name>, e.g. make report RUN=demo))
	$(PY) pipeline.py report $(RUN) --artifacts $(ARTIFACTS) $(ARGS)

# make clean-latents RUN=<run>: delete one cache or output of a run; the next `make` rebuilds it (and,
# through the fingerprints, everything that read it). Do not clean a stage while it runs.
clean-latents clean-captions clean-lora clean-samples:
	$(if $(RUN),,$(error set RUN=<run name>, e.g. make $@ RUN=demo))
	rm -rf $(addprefix $(ARTIFACTS)/$(RUN)/,$(CLEAN_$@))

CLEAN_clean-latents  = latents.zarr
CLEAN_clean-captions = captions.zarr
CLEAN_clean-lora     = lora export
CLEAN_clean-samples  = samples

# make docs-images (after make demo): the README's pictures, palette-quantized to stay small
docs-images: venv
	$(PY) -c "from PIL import Image; [Image.open(s).convert('RGB').quantize(256).save(d, optimize=True) for s, d in [('$(ARTIFACTS)/demo/samples/grid.png', 'docs/demo_samples.png'), ('$(ARTIFACTS)/demo/report.png', 'docs/demo_loss.png')]]"
	@ls -l docs/demo_samples.png docs/demo_loss.png
