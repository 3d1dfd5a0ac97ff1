#!/usr/bin/env bash
# One idempotent set-up step for ringtrain, called by `make train` and `make test`.
# It finds (or installs) MPI and the Debian packages the tests use, creates .venv with
# the pinned Python stack, builds Horovod against that TensorFlow (cached), verifies the
# result in 2 ranks, and installs ringtrain in editable mode. A second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
HOROVOD_VERSION=0.28.1
CACHE=${RINGTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ringtrain}
say() { echo "[setup] $*"; }
die() { echo "[setup] error: $*" >&2; exit 1; }

# --- Debian packages -------------------------------------------------------------------
# MPI: an HPC module that already provides mpicc and mpirun wins; otherwise Debian's Open MPI.
# Slurm and munge are only for the test suite's real single-node cluster.
apt_wanted=()
if ! { command -v mpicc >/dev/null && command -v mpirun >/dev/null; }; then
  apt_wanted+=(openmpi-bin libopenmpi-dev)
fi
command -v cmake >/dev/null || apt_wanted+=(cmake)
command -v g++ >/dev/null || apt_wanted+=(g++)
command -v patch >/dev/null || apt_wanted+=(patch)
for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${tool%%:*}" >/dev/null || apt_wanted+=("${tool#*:}")
done
# The rehearsal cluster (`ringtrain cluster`, used by the tests): namespaces, veths and link
# caps come from iproute2 (ip, tc), and every node runs its own sshd.
for tool in ip:iproute2 tc:iproute2 ssh:openssh-client sshd:openssh-server; do
  PATH=$PATH:/usr/sbin:/sbin command -v "${tool%%:*}" >/dev/null || apt_wanted+=("${tool#*:}")
done
if ((${#apt_wanted[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian packages: ${apt_wanted[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${apt_wanted[@]}" | sort -u) >/dev/null
  else
    die "missing ${apt_wanted[*]}: load your site's MPI module (mpicc, mpirun), cmake and g++, or run this as root on Debian/Ubuntu"
  fi
fi

# --- the virtual environment ------------------------------------------------------------
[[ -x $VENV/bin/python ]] || { say "creating $VENV"; python3 -m venv "$VENV"; }
PY=$VENV/bin/python
req_stamp=$VENV/.requirements.sha256
req_hash=$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [[ ! -f $req_stamp || $(cat "$req_stamp") != "$req_hash" ]]; then
  say "installing requirements.txt into .venv (TensorFlow takes a minute or two)"
  "$PY" -m pip install -q --upgrade pip wheel setuptools
  "$PY" -m pip install -q -r requirements.txt
  "$PY" -m pip install -q --no-deps -r requirements-nodeps.txt  # keras-hub without tensorflow-text
  echo "$req_hash" >"$req_stamp"
fi

# --- Horovod, built against the TensorFlow in .venv ------------------------------------
# Horovod 0.28.1 ships only as an sdist. Its XLA custom-call op (horovod/tensorflow/
# xla_mpi_ops.cc) includes tensorflow/compiler/xla/client/xla_builder.h, which TF >= 2.19
# no longer ships, so a plain pip install fails at the very end. That op serves only
# XLA-compiled GPU graphs; the CPU/MPI path never uses it, so we drop it from the build.
# horovod-allreduce-in-place.patch lets the allreduce op reduce a tensor nothing else holds
# in its own buffer (MPI_IN_PLACE), as a compiled step's gradients are (docs/howto/install.md).
# The wheel is cached by Horovod, TF and Python version and the patch: a change rebuilds it.
tf_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
patch_file=$ROOT/scripts/horovod-allreduce-in-place.patch
patch_tag=$(sha256sum "$patch_file" | cut -c1-8)
build_key="horovod-$HOROVOD_VERSION-tf$tf_version-$py_tag-$patch_tag"
wheel_dir=$CACHE/wheels/$build_key
hvd_stamp=$VENV/.horovod-build
if [[ ! -f $hvd_stamp || $(cat "$hvd_stamp") != "$build_key" ]]; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    say "building Horovod $HOROVOD_VERSION against TensorFlow $tf_version (about 4 minutes)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
    src=$work/horovod-$HOROVOD_VERSION
    sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    patch -s -p1 -d "$src" <"$patch_file"
    mkdir -p "$wheel_dir.tmp"
    (cd "$src" && HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$wheel_dir.tmp" . >"$work/build.log" 2>&1) ||
      { tail -30 "$work/build.log" >&2; die "the Horovod build failed (log above)"; }
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  say "installing cached Horovod wheel $build_key"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging  # horovodrun's own needs
  echo "$build_key" >"$hvd_stamp"
fi

# --- ringtrain itself -------------------------------------------------------------------
src_stamp=$VENV/.ringtrain-editable
if [[ ! -f $src_stamp || setup.cfg -nt $src_stamp || pyproject.toml -nt $src_stamp ]]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  touch "$src_stamp"
fi

# horovodrun imports TensorFlow itself (its build check) before it starts any rank, in a
# process ringtrain never runs in. TensorFlow's import-time notices ignore the log level, so
# every Python in the venv loads ringtrain.quiet at start-up (a .pth line), which holds them
# back; the activated venv carries the level, and a value the user exports wins.
activate_line='export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}  # ringtrain'
grep -qxF "$activate_line" "$VENV/bin/activate" || echo "$activate_line" >>"$VENV/bin/activate"
# horovodrun gives its tasks 30 s to start by default; a loaded node importing TensorFlow in
# every rank at once takes longer. The venv sets 120 s (a value the user exports wins).
activate_line='export HOROVOD_START_TIMEOUT=${HOROVOD_START_TIMEOUT:-120}  # ringtrain'
grep -qxF "$activate_line" "$VENV/bin/activate" || echo "$activate_line" >>"$VENV/bin/activate"
# Open MPI's launcher waits minutes on a node that went silent (power loss, partition) unless
# its out-of-band keepalive is short. The venv carries a parameter file that shortens it, and
# activate names it (between the user's own file, which still wins, and the system's), so every
# mpirun and horovodrun started from the venv ends such a job within seconds. Nothing
# system-wide changes. ringtrain/launch/keepalive.py says more.
mca_files=$("$PY" -m ringtrain.launch.keepalive "$VENV/etc/ringtrain-mca-params.conf")
sed -i '/# ringtrain-mca$/d' "$VENV/bin/activate"
echo "export OMPI_MCA_mca_param_files=\"\${OMPI_MCA_mca_param_files:-$mca_files}\"  # ringtrain-mca" >>"$VENV/bin/activate"
site_packages=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import importlib.util; importlib.util.find_spec("ringtrain") and __import__("ringtrain.quiet")' \
  >"$site_packages/ringtrain-quiet.pth"

# --- verify -------------------------------------------------------------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=3
build_report=$("$VENV/bin/horovodrun" --check-build 2>/dev/null)
grep -qE '\[X\] TensorFlow' <<<"$build_report" || die "Horovod lacks TensorFlow ops (rm -rf $wheel_dir and rerun)"
grep -qE '\[X\] MPI' <<<"$build_report" || die "Horovod lacks the MPI controller (rm -rf $wheel_dir and rerun)"
mpirun -np 2 --oversubscribe "$PY" -c 'import horovod.tensorflow as hvd; hvd.init(); assert hvd.size() == 2' 2>/dev/null ||
  die "importing horovod.tensorflow in 2 MPI ranks failed"
say "ok: .venv ready (TensorFlow $tf_version, Horovod $HOROVOD_VERSION with MPI)"
