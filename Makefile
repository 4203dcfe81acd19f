# make demo | make test | make encode-captions CONFIG=configs/flux-dev.toml | make train ... (README "Using make")
PY      ?= .venv/bin/python
CONFIG  ?= configs/demo.toml
FAMILY  ?= flux
ARGS    ?=

.PHONY: demo test venv encode-captions cache-latents train export-lora run status clean-latents clean-captions clean-lora

venv: .venv/.installed

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -e '.[test]'
	touch $@

demo: venv
	$(PY) pipeline.py demo --family $(FAMILY)

test: venv
	$(PY) -m pytest -q tests

run: venv
	$(PY) pipeline.py run --config $(CONFIG) $(ARGS)

encode-captions cache-latents train export-lora: venv
	$(PY) pipeline.py run --config $(CONFIG) --only $@ $(ARGS)

status: venv
	$(PY) pipeline.py status --config $(CONFIG)
