# The two commands: `make demo` runs the main job on the embedded default, `make test` runs the suite.
# Both bootstrap what they need (venv, packages, ROS 2 interfaces, the zoo bundle) and skip what is done.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test demo bootstrap bundles clean-build help

help:
	@echo "make test   - bootstrap, then run the whole test suite"
	@echo "make demo   - bootstrap, then run the main job on the embedded zoo model"
	@echo "make bundles - (re)build build/bundles/zoo from zoo/"

bootstrap:
	@scripts/bootstrap.sh all

bundles:
	@scripts/bootstrap.sh bundles

test: bootstrap
	$(PY) -m pytest -q

demo:
	@scripts/bootstrap.sh demo
	@scripts/demo.sh

clean-build:
	rm -rf build ros2_ws/build
