#!/usr/bin/env bash
# tpplan on another torch: builds (or reuses) a virtual environment with torch VERSION and runs a
# named subset of the suite against the checkout it is run in, one pass/fail line per part:
#
#   validate  `tpplan validate` at 1,024 ranks (plans/llama-3d.yaml, plans/qwen3-moe-ep.yaml)
#   verify    `tpplan verify` of every plan in plans/ at the smallest world size (2 or more) its
#             mesh takes; plans that start from a pretrained folder read tiny ones made by
#             scripts/make_tiny_hf.py
#   train     the Quickstart's torchrun command, 4 steps; then `tpplan train --nproc 4 --resume`
#             (the launcher tpplan builds on torchrun), 2 steps more
#   search    the README's `tpplan search` (8 ranks, h100)
#   pytest    tests/test_architecture.py, test_plan_errors.py, test_dry_run_analysis.py and
#             test_torch_door.py where it exists
#
#   scripts/check_torch.sh VERSION [--venv DIR] [--out DIR] [--lock FILE] [--only PART,...]
#
# --only names the parts to run (`--only env`: the environment alone, no part).
# The environment is /tmp/torchvenv-VERSION unless --venv says otherwise; it gets `torch==VERSION`
# from the package index (only the registry's CPU build where it has one: other versions bring the
# CUDA build, several GB, which runs on CPU all the same) and the project's dependencies with its
# `test` and `hf` extras, read from pyproject.toml, torch pinned to the one installed; tpplan
# itself is not installed: PYTHONPATH points at this checkout, so one environment serves any
# checkout. Logs go to --out (a new folder under /tmp by default). --lock FILE runs the parts
# under `flock FILE` (the environment's downloads do not wait for it). Exit 0 when every part
# passes, 1 when one fails, 2 when torch VERSION cannot be installed or the environment breaks.
set -uo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }

VERSION=""
VENV=""
OUT=""
LOCK=""
ONLY="validate,verify,train,search,pytest"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --venv) VENV=${2:?--venv needs a folder}; shift 2 ;;
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        --lock) LOCK=${2:?--lock needs a file}; shift 2 ;;
        --only) ONLY=${2:?--only needs parts}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "check_torch: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
        *) [[ -z "$VERSION" ]] || { echo "check_torch: one VERSION only" >&2; exit 2; }
           VERSION=$1; shift ;;
    esac
done
[[ -n "$VERSION" ]] || { usage >&2; exit 2; }

# The checkout: the folder it is run in when that is one, else the one this script lives in.
ROOT=$(pwd)
if [[ ! -f "$ROOT/pyproject.toml" || ! -d "$ROOT/tpplan" ]]; then
    ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fi
VENV=${VENV:-/tmp/torchvenv-$VERSION}
OUT=${OUT:-$(mktemp -d "/tmp/check_torch-$VERSION.XXXX")}
mkdir -p "$OUT"
PY="$VENV/bin/python"

say() { echo "check_torch: $*"; }
torch_of() { "$PY" -c "import torch; print(torch.__version__)" 2>/dev/null; }

# --- the environment -------------------------------------------------------------------------
have=$( [[ -x "$PY" ]] && torch_of )
if [[ "${have%%+*}" != "$VERSION" ]]; then
    say "building $VENV with torch==$VERSION (log: $OUT/venv.log)"
    [[ -x "$PY" ]] || python3 -m venv "$VENV" >>"$OUT/venv.log" 2>&1 || { say "cannot make $VENV"; exit 2; }
    if ! "$PY" -m pip install "torch==$VERSION" >>"$OUT/venv.log" 2>&1; then
        tail -n 5 "$OUT/venv.log"
        say "torch $VERSION cannot be installed from the package index (see $OUT/venv.log)"
        exit 2
    fi
    have=$(torch_of)
fi
[[ "${have%%+*}" == "$VERSION" ]] || { say "torch in $VENV is '$have', not $VERSION"; exit 2; }

# The project's dependencies (test and hf extras), torch left out and pinned to the one installed.
DEPS=$("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + [r for extra in ("test", "hf") for r in project["optional-dependencies"][extra]]
print("\n".join(r for r in reqs if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() != "torch"))
EOF
) || { say "cannot read $ROOT/pyproject.toml"; exit 2; }
STAMP="$VENV/.check_torch_deps"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$DEPS" ]]; then
    say "installing the project's dependencies into $VENV (torch kept at $have)"
    # The distribution's own version (2.14.1), not torch.__version__'s (2.14.1+cu130): pip matches that.
    "$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$VENV/.check_torch_constraints"
    mapfile -t reqs <<<"$DEPS"
    if ! "$PY" -m pip install -c "$VENV/.check_torch_constraints" "${reqs[@]}" >>"$OUT/venv.log" 2>&1; then
        tail -n 5 "$OUT/venv.log"
        say "the dependencies do not install beside torch $have (see $OUT/venv.log)"
        exit 2
    fi
    echo "$DEPS" >"$STAMP"
fi
now=$(torch_of)
[[ "$now" == "$have" ]] || { say "pip replaced torch $have with '$now'"; exit 2; }

# --- the machine -----------------------------------------------------------------------------
cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
say "machine: ${cpu:-unknown CPU}, $(OMP_NUM_THREADS='' nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
say "torch $now, $("$PY" -V 2>&1), checkout $ROOT$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null | sed 's/^/ at /')"
say "logs in $OUT"
"$PY" -c "import tpplan, sys; sys.exit(0 if tpplan.__file__.startswith('$ROOT/') else 1)" \
    || { say "python imports tpplan from somewhere other than $ROOT"; exit 2; }

if [[ -n "$LOCK" ]]; then
    exec 9>"$LOCK"
    say "waiting for $LOCK"
    flock 9
fi

# --- the parts -------------------------------------------------------------------------------
RESULTS=()
FAILED=0
wants() { [[ ",$ONLY," == *",$1,"* ]]; }

# part NAME DIR COMMAND...: runs COMMAND in DIR, its output in $OUT/NAME.log; one line.
part() {
    local name=$1 dir=$2 start end status line
    shift 2
    start=$(date +%s)
    (cd "$dir" && "$@") >"$OUT/$name.log" 2>&1
    status=$?
    end=$(date +%s)
    if [[ $status -eq 0 ]]; then
        line=$(printf 'PASS  %-40s %4ss' "$name" "$((end - start))")
    else
        line=$(printf 'FAIL  %-40s %4ss  (exit %s, %s)' "$name" "$((end - start))" "$status" "$OUT/$name.log")
        FAILED=1
    fi
    echo "$line"
    [[ $status -eq 0 ]] || grep -E "Error|error:|FAIL|unrecognized" "$OUT/$name.log" | tail -n 3 | sed 's/^/      /'
    RESULTS+=("$line")
}

WORK="$OUT/work"
mkdir -p "$WORK"

if wants validate; then
    for plan in llama-3d qwen3-moe-ep; do
        part "validate-$plan@1024" "$WORK" "$PY" -m tpplan validate --plan "$ROOT/plans/$plan.yaml" --world-size 1024
    done
fi

if wants verify; then
    # The smallest world size of 2 or more that each plan's mesh takes, and whether it is pretrained.
    sizes=$("$PY" - "$ROOT"/plans/*.yaml <<'EOF'
import sys
import tpplan
for path in sys.argv[1:]:
    plan = tpplan.load(path)
    for world in range(2, 65):
        try:
            plan.parallel_dims(world)
        except Exception:
            continue
        print(path, world, plan.spec.model.pretrained or "-")
        break
    else:
        print(path, 0, "-")
EOF
    ) || { RESULTS+=("FAIL  verify: cannot load the plans"); echo "${RESULTS[-1]}"; FAILED=1; }
    TINY="$VENV/tiny"
    while read -r path world pretrained; do
        name="verify-$(basename "$path" .yaml)@$world"
        if [[ "$world" == 0 ]]; then
            RESULTS+=("FAIL  $name: no world size up to 64 fits its mesh"); echo "${RESULTS[-1]}"
            FAILED=1; continue
        fi
        dir="$WORK"
        if [[ "$pretrained" != "-" ]]; then
            family=${pretrained#tiny-}; family=${family//-/_}
            if [[ ! -f "$TINY/$pretrained/config.json" ]]; then
                mkdir -p "$TINY"
                "$PY" "$ROOT/scripts/make_tiny_hf.py" --family "$family" --out "$TINY/$pretrained" \
                    >"$OUT/make-$pretrained.log" 2>&1 || { rm -rf "${TINY:?}/$pretrained"; }
            fi
            dir="$TINY"
        fi
        part "$name" "$dir" "$PY" -m tpplan verify --plan "$path" --nproc "$world"
    done <<<"$sizes"
fi

if wants train; then
    part "train-quickstart-torchrun" "$WORK" "$VENV/bin/torchrun" --standalone --nproc-per-node 4 -m tpplan train \
        --plan "$ROOT/plans/llama.yaml" --set train.steps=4 --set metrics.run_dir="$WORK/runs/llama" --overwrite
    part "train-nproc-resume" "$WORK" "$PY" -m tpplan train --plan "$ROOT/plans/llama.yaml" --nproc 4 --resume \
        --set train.steps=6 --set metrics.run_dir="$WORK/runs/llama"
fi

if wants search; then
    part "search-llama@8" "$WORK" "$PY" -m tpplan search --plan "$ROOT/plans/llama.yaml" --world-size 8 \
        --device h100 --set train.seq_len=64 --set train.global_batch_size=16 --top 5
fi

if wants pytest; then
    tests=()
    for t in test_architecture test_plan_errors test_dry_run_analysis test_torch_door; do
        [[ -f "$ROOT/tests/$t.py" ]] && tests+=("tests/$t.py")
    done
    part "pytest-subset" "$ROOT" "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
fi

echo
passed=0
failed=0
for line in "${RESULTS[@]}"; do
    if [[ "$line" == PASS* ]]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
say "torch $now: $passed passed, $failed failed$( ((FAILED)) && echo ' (see the FAIL lines)')"
exit $FAILED
