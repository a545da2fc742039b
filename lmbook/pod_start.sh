# lmbook's pod start script. `lmbook.pods.runpod.start_command` sends it, gzipped and base64-encoded, as the
# container's start command, with the supervisor (lmbook/pods/supervise.py, standard library only) inside it;
# bash runs it as the container's PID 1. It starts the image's own start script (sshd, JupyterLab) and the
# supervisor, passes a container stop's signal on to the supervisor, and exits with it: the supervisor owns the
# pod's end (see its module). The supervisor runs this script again as its install stage (`install`), which
# puts lmbook on the volume: the exact commit of $LMBOOK_COMMIT from $LMBOOK_REPO.
W=${LMBOOK_WORKSPACE:-/workspace}
S=${LMBOOK_SRC:-$W/lmbook}
V=${LMBOOK_VENV:-$W/venvs/lmbook}
T=$(dirname "$0")
mkdir -p "$W/logs"
L=$W/logs/boot-${RUN_EXPERIMENT:-run}.log
say() { echo "[boot $(date -u +%T)] $*" >> "$L"; }
no() { say "install: $*"; return 1; }

install() {  # the checkout and its virtualenv on the volume, at the commit the pod was created with
  say "stage 1/4 install: lmbook ${LMBOOK_COMMIT:-(newest)} from ${LMBOOK_REPO:-(no repository)} into $V"
  if [ ! -e "$S/.git" ]; then git clone -q "$LMBOOK_REPO" "$S" || { no "git clone $LMBOOK_REPO failed"; return; }; fi
  if [ -n "$LMBOOK_COMMIT" ] && [ "$(git -C "$S" rev-parse HEAD 2>/dev/null)" != "$LMBOOK_COMMIT" ]; then
    git -C "$S" cat-file -e "$LMBOOK_COMMIT^{commit}" 2>/dev/null || git -C "$S" fetch -q "$LMBOOK_REPO" "$LMBOOK_COMMIT" 2>/dev/null ||
      git -C "$S" fetch -q --tags "$LMBOOK_REPO" '+refs/heads/*:refs/remotes/lmbook/*' || { no "git fetch $LMBOOK_REPO failed"; return; }
    git -C "$S" checkout -q "$LMBOOK_COMMIT" || { no "commit $LMBOOK_COMMIT cannot be checked out in $S"; return; }
  fi
  [ -x "$V/bin/python" ] || python3 -m venv --system-site-packages "$V" ||
    { python3 -m pip install -q virtualenv && python3 -m virtualenv -q --system-site-packages "$V"; } || { no "no virtualenv in $V"; return; }
  if [ ! -x "$V/bin/lmbook" ]; then
    "$V/bin/pip" install -q -e "$S" && git -C "$S" rev-parse HEAD > "$V/lmbook-commit" || { no "pip install -e $S failed"; return; }
  fi
  [ "${SERVE_ENGINE:-}" != vllm ] || "$V/bin/python" -c 'import vllm' 2>/dev/null || "$V/bin/pip" install -q vllm || no "pip install vllm failed"
}

[ "${1:-}" != install ] || { install; exit; }
touch "$L"
tail -n 0 -F "$L" 2>/dev/null &  # the boot log on the container's stdout too: RunPod's logs show it without SSH
"${LMBOOK_START:-/start.sh}" &  # the image's own start script: sshd, JupyterLab, RunPod's proxy
# an endpoint pod (RUN_SERVE: pod create --serve) serves a model instead of training one, behind $LMBOOK_API_KEY
if [ -z "${RUN_SERVE:-}" ]; then set -- "$V/bin/lmbook" boot
elif [ "${SERVE_ENGINE:-lmbook}" = vllm ]; then  # vLLM's OpenAI server; the key as VLLM_API_KEY, never an argument
  export VLLM_API_KEY="$LMBOOK_API_KEY"
  set -- "$V/bin/python" -m vllm.entrypoints.openai.api_server --model "$RUN_SERVE" --served-model-name "${RUN_SERVE##*/}" --host 0.0.0.0 --port "${SERVE_PORT:-8000}"
else set -- "$V/bin/lmbook" serve "$RUN_SERVE" --host 0.0.0.0 --port "${SERVE_PORT:-8000}"; fi
cat > "$T/lmbook-supervise.py" <<'LMBOOK_SUPERVISOR'
@SUPERVISOR@
LMBOOK_SUPERVISOR
python3 "$T/lmbook-supervise.py" "$L" "$0" "$V/bin/lmbook" "$@" &
P=$!
G=
trap 'G=1; kill -TERM $P' TERM
trap 'G=1; kill -HUP $P' HUP
trap 'G=1; kill -INT $P' INT
while kill -0 $P 2>/dev/null; do wait $P; rc=$?; done
# the supervisor killed from outside (the out-of-memory killer) cannot end the pod: the container's end does
[ -n "$G" ] || [ $rc -le 128 ] || say "pod: the supervisor was killed (exit code $rc): the container ends"
exit $rc
