# The two commands: `make reproduce` (the article's results, our numbers) and `make test`.
# Both create or reuse .venv and install what is missing (a stamp file makes a second run quick).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# On Linux x86-64 take torch 2.13.0, whose CPU build lies on these machines' disk; elsewhere any
# recent torch (override with `make TORCH=torch ...`).
TORCH ?= $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),torch==2.13.0,torch)
MODEL ?= bundled

.PHONY: setup node-deps test reproduce bench-detok bench-load bench-qoe bench-guidellm lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,dev,plot]"
	touch $@

# The Node clients of tests/test_node.py, pinned in tests/node/package-lock.json, into
# tests/node/node_modules (npm's cache beside it, both gitignored). Without npm, or offline, it says
# so and goes on: those tests are then skipped, saying why (.ci/run runs npm ci itself, to fail).
NODE_DEPS := tests/node/node_modules/.package-lock.json
node-deps: $(NODE_DEPS)

$(NODE_DEPS): tests/node/package-lock.json
	@command -v npm >/dev/null || { echo "no npm here: tests/test_node.py will be skipped"; exit 0; }; \
	npm_config_cache=$(CURDIR)/tests/node/.npm-cache npm ci --prefix tests/node --no-audit --no-fund --loglevel=error || \
	echo "npm ci failed: tests/test_node.py will be skipped"

test: $(STAMP) $(NODE_DEPS)
	PYTHONASYNCIODEBUG=1 $(BIN)/python -m pytest

reproduce: $(STAMP)
	@mkdir -p results && touch results/.reproduce-start  # to list only what this run wrote
	@echo "== scripts/split_chars.py: a character split across tokens"
	$(BIN)/python scripts/split_chars.py --model $(MODEL)
	@echo "== scripts/event_bytes.py: what one piece of text costs on the wire"
	$(BIN)/python scripts/event_bytes.py
	@echo "== scripts/reading_speed.py: is generation faster than reading?"
	$(BIN)/python scripts/reading_speed.py --model $(MODEL)
	@echo "== experiments.py all: /complete vs /stream vs /ws, a reader leaving, saying stop, and the proxy"
	$(BIN)/python experiments.py all --model $(MODEL)
	@echo "== Debian's nginx, chromium and CJK and Thai fonts, for the next two (as root, when missing)"
	@(command -v nginx && command -v chromium && [ -d /usr/share/fonts/opentype/noto ]) >/dev/null || \
		[ "$$(id -u)" != 0 ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends nginx chromium fonts-noto-cjk fonts-thai-tlwg >/dev/null) || \
		echo "not installed: run apt-get install nginx chromium fonts-noto-cjk fonts-thai-tlwg as root"
	@echo "== experiments.py nginx: the same path through a real nginx"
	$(BIN)/python experiments.py nginx --model $(MODEL)
	@echo "== experiments.py page: the browser page mid-stream"
	$(BIN)/python experiments.py page --model $(MODEL)
	@echo "== written:" $$(find results -type f -newer results/.reproduce-start ! -name '.*' | sort)

bench-detok: $(STAMP)
	$(BIN)/python scripts/bench_detok.py

bench-load: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python scripts/bench.py load --model $(MODEL)

bench-qoe: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python scripts/bench.py qoe --model $(MODEL)

bench-guidellm: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python scripts/bench.py guidellm --model $(MODEL)

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy  # the whole package and lm.py: the wire layer strictly, every function elsewhere annotated (pyproject.toml)
	# Every test module imports (mypy reads the package, not tests/): a helper one test module took
	# from another, moved away, once failed CI at collection after only the changed modules had run
	@$(BIN)/python -m pytest --collect-only -qq >/tmp/collect.$$$$ 2>&1 || { tail -30 /tmp/collect.$$$$; rm -f /tmp/collect.$$$$; exit 1; }; \
		rm -f /tmp/collect.$$$$; echo "pytest: every test module imports"

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) results .pytest_cache tests/node/node_modules tests/node/.npm-cache
