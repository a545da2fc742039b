# lmbook's pod start script. `lmbook.runpod.start_command` sends it gzipped and base64-encoded as the container's
# start command, so it runs as the container's PID 1. It installs lmbook on the volume (the exact commit of
# $LMBOOK_COMMIT from $LMBOOK_REPO), starts `lmbook boot` in the background, runs the image's own start script
# (sshd, JupyterLab) beside it, and passes a container stop's SIGTERM on to boot, which checkpoints the run.
# A stage that fails before boot runs stops the pod through RunPod's API (the guard), logging why on the volume;
# so does the spend guard, which counts from the pod's create time; both say so to $LMBOOK_ALERT_URL when it is set
# (the alert's forms are lmbook.runs.alert's). A stop the API does not take within
# LMBOOK_STOP_DEADLINE seconds ends this script instead: an exited container is EXITED, which bills no GPU time.
W=${LMBOOK_WORKSPACE:-/workspace}
S=${LMBOOK_SRC:-$W/lmbook}
V=${LMBOOK_VENV:-$W/venvs/lmbook}
mkdir -p "$W/logs"
L=$W/logs/boot-${RUN_EXPERIMENT:-run}.log
say() { echo "[boot $(date -u +%T)] $*" >> "$L"; }
touch "$L"
tail -n 0 -F "$L" 2>/dev/null &  # the boot log on the container's stdout too: RunPod's logs show it without SSH
export LMBOOK_START_PID=$$  # boot asks this script to exit when the API cannot stop the pod
# the spend guard's clock: the create time on the pod's first start (the image pull counts), else this start's
SPEND=$W/logs/spend-${RUNPOD_POD_ID:-local}.json
if [ -z "$LMBOOK_T0" ] || [ -e "$SPEND" ]; then export LMBOOK_T0=$(date +%s); fi

api_stop() {  # one stop through REST v2 with the pod's own key: the HTTP status (0: no answer)
  python3 -c 'import json, os, urllib.request as u
url = os.environ.get("RUNPOD_API_BASE_URL", "https://api.runpod.io").rstrip("/") + "/v2/pods/" + os.environ["RUNPOD_POD_ID"] + "/action"
req = u.Request(url, json.dumps({"action": "stop"}).encode(), {"Authorization": "Bearer " + os.environ.get("RUNPOD_API_KEY", ""),
                "Content-Type": "application/json"})
try: print(u.urlopen(req, timeout=30).status)
except Exception as e: print(getattr(e, "code", 0))' 2>> "$L"
}

alert() {  # event $1, text $2 to the webhook $LMBOOK_ALERT_URL, if set: `lmbook alert` once it runs, else python3
  [ -n "$LMBOOK_ALERT_URL" ] || return 0
  if [ -x "$V/bin/lmbook" ] && "$V/bin/lmbook" alert "$1" "$2" >> "$L" 2>&1; then return 0; fi
  python3 - "$1" "$2" >> "$L" 2>&1 <<'PY'
import json, os, socket, sys, urllib.parse, urllib.request as u
event, text, url = sys.argv[1], sys.argv[2], os.environ["LMBOOK_ALERT_URL"]
exp, host, p = os.environ.get("RUN_EXPERIMENT", ""), socket.gethostname(), urllib.parse.urlsplit(url)
name = (p.hostname or "").lower()
title = "lmbook: %s %s" % (exp or host, event.replace("_", " "))
h = {"Content-Type": "application/json", "User-Agent": "lmbook-start"}
if name == "hooks.slack.com": d = {"text": "*%s*\n%s" % (title, text)}
elif name.split(".")[-2:] in (["discord", "com"], ["discordapp", "com"]) and p.path.startswith("/api/webhooks/"):
    d = {"content": ("**%s**\n%s" % (title, text))[:2000]}
elif "ntfy" in name:
    d, h = None, dict(h, Title=title, Tags={"failed": "x", "spend_limit": "moneybag"}.get(event, "bell"), Priority="high")
    h["Content-Type"] = "text/plain; charset=utf-8"
else: d = {"event": event, "title": title, "text": text, "experiment": exp, "host": host, "pod": os.environ.get("RUNPOD_POD_ID")}
body = text.encode() if d is None else json.dumps(d).encode()
try: u.urlopen(u.Request(url, body, h), timeout=10).read()
except Exception as e: sys.exit("alert: the %s alert was not delivered (%s)" % (event, getattr(e, "code", "") or getattr(e, "reason", "") or type(e).__name__))
print("%s alert delivered" % event)
PY
}

stop_pod() {  # the guard: stop this pod (runpodctl, else REST v2), retried with backoff; else end the container
  say "guard: $1: stopping pod ${RUNPOD_POD_ID:-?} (the volume keeps this log)"
  case $1 in
    "spend guard"*) alert spend_limit "$1. The pod is being stopped; its volume keeps everything." ;;
    *) alert failed "$1. The pod is being stopped; the boot log on its volume says more." ;;
  esac
  [ -n "$RUNPOD_POD_ID" ] || { say "guard: RUNPOD_POD_ID is not set: not a RunPod pod, nothing to stop"; return 1; }
  t0=$(date +%s); i=0; deadline=${LMBOOK_STOP_DEADLINE:-600}
  while :; do
    if command -v runpodctl >/dev/null 2>&1 && runpodctl stop pod "$RUNPOD_POD_ID" >> "$L" 2>&1; then
      say "guard: pod stopped (runpodctl)"; return 0
    fi
    code=$(api_stop)
    case $code in
      2*) say "guard: pod stopped (REST API)"; return 0 ;;
      404) say "guard: pod $RUNPOD_POD_ID is gone already"; return 0 ;;
      429|5*|0) ;;
      *) break ;;  # a refusal no retry changes (a wrong key)
    esac
    [ $(( $(date +%s) - t0 )) -lt "${deadline%.*}" ] || break
    p=$(awk -v i=$i -v m="${LMBOOK_STOP_PAUSE:-60}" 'BEGIN { p = 2 ^ i; print (p < m ? p : m) }')
    say "guard: no stop yet (answer ${code:-none}); trying again in $p s"
    sleep "$p"; i=$((i + 1))
  done
  say "guard: RunPod's API did not stop pod $RUNPOD_POD_ID (last answer: ${code:-none}): ending the container instead, which bills no GPU time"
  kill -TERM "$LMBOOK_START_PID"
  return 1
}

spend_watch() {  # the spend guard until lmbook boot runs (it guards from then on): the seconds left, then a stop
  [ -n "$MAX_HOURS$MAX_DOLLARS" ] || return 0
  left=$(SPEND=$SPEND python3 -c 'import json, os, time
e = lambda k: float(os.environ.get(k) or 0)
lims = [x for x in (e("MAX_HOURS")*3600, e("MAX_DOLLARS")/e("PRICE_PER_HOUR")*3600 if e("PRICE_PER_HOUR") else 0) if x]
try: d = json.load(open(os.environ["SPEND"]))
except Exception: d = {}
before = float(d.get("seconds_before", 0)) + float(d.get("seconds", 0))
print(max(0, min(lims) - before - (time.time() - e("LMBOOK_T0"))) if lims else "")' 2>> "$L")
  [ -n "$left" ] || return 0
  sleep "$left"
  stop_pod "spend guard: the pod reached MAX_HOURS/MAX_DOLLARS before lmbook boot ran"
}

install() {  # stage 1: the checkout and its virtualenv on the volume, at the commit the pod was created with
  say "stage 1/4 install: lmbook ${LMBOOK_COMMIT:-(newest)} from ${LMBOOK_REPO:-(no repository)} into $V"
  [ -n "$LMBOOK_REPO" ] || { stop_pod "LMBOOK_REPO is not set (create pods with lmbook pod create)"; return 1; }
  if [ ! -e "$S/.git" ]; then
    git clone -q "$LMBOOK_REPO" "$S" || { stop_pod "git clone $LMBOOK_REPO failed"; return 1; }
  fi
  if [ -n "$LMBOOK_COMMIT" ] && [ "$(git -C "$S" rev-parse HEAD 2>/dev/null)" != "$LMBOOK_COMMIT" ]; then
    git -C "$S" cat-file -e "$LMBOOK_COMMIT^{commit}" 2>/dev/null || git -C "$S" fetch -q "$LMBOOK_REPO" "$LMBOOK_COMMIT" 2>/dev/null ||
      git -C "$S" fetch -q --tags "$LMBOOK_REPO" '+refs/heads/*:refs/remotes/lmbook/*' || { stop_pod "git fetch $LMBOOK_REPO failed"; return 1; }
    git -C "$S" checkout -q "$LMBOOK_COMMIT" || { stop_pod "commit $LMBOOK_COMMIT cannot be checked out in $S"; return 1; }
  fi
  [ -x "$V/bin/python" ] || python3 -m venv --system-site-packages "$V" ||
    { python3 -m pip install -q virtualenv && python3 -m virtualenv -q --system-site-packages "$V"; } || { stop_pod "no virtualenv in $V"; return 1; }
  if [ ! -x "$V/bin/lmbook" ]; then
    "$V/bin/pip" install -q -e "$S" && git -C "$S" rev-parse HEAD > "$V/lmbook-commit" || { stop_pod "pip install -e $S failed"; return 1; }
    nvidia-smi -L > /dev/null 2>&1 && float8
  fi
  "$V/bin/lmbook" boot --help > /dev/null || { stop_pod "lmbook does not start from $V"; return 1; }
}

float8() {  # torchao for fp8='auto', the release built for the image's torch; without it runs train in bf16
  "$V/bin/python" -c 'import torchao' 2> /dev/null && return 0
  local t ao; t=$("$V/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
  case $t in
    2.8.*) ao=0.13.0 ;; 2.9.0) ao=0.14.1 ;; 2.9.*) ao=0.15.0 ;; 2.10.*) ao=0.16.0 ;; 2.11.*) ao=0.18.0 ;;
    *) say "install: no torchao release known for torch $t: fp8='auto' runs train in bf16"; return 0 ;;
  esac
  "$V/bin/pip" install -q "torchao==$ao" && say "install: torchao $ao for torch $t (float8)" ||
    say "install: pip install torchao==$ao failed: fp8='auto' runs train in bf16"
}

vllm_serve() {  # vLLM's OpenAI server on the exported model; the key goes as VLLM_API_KEY, never on a command line
  "$V/bin/python" -c 'import vllm' 2>/dev/null || "$V/bin/pip" install -q vllm || { stop_pod "pip install vllm failed"; return 1; }
  export VLLM_API_KEY="$LMBOOK_API_KEY"
  exec "$V/bin/python" -m vllm.entrypoints.openai.api_server --model "$RUN_SERVE" --served-model-name "$(basename "$RUN_SERVE")" \
    --host 0.0.0.0 --port "${SERVE_PORT:-8000}"
}


pass() {  # a container stop signals PID 1 only: pass it on to boot, wait until boot has checkpointed the run
  say "start: got SIG$1: passing SIGTERM on to lmbook boot (pid $B) and waiting for it"
  kill -TERM "$B" 2>/dev/null
  rc=$2
  while kill -0 "$B" 2>/dev/null; do wait "$B"; rc=$?; done
  say "start: boot has stopped (exit code $rc)"
  exit "$rc"
}
trap 'pass TERM 143' TERM
trap 'pass HUP 129' HUP
trap 'pass INT 130' INT

# an endpoint pod (RUN_SERVE: pod create --serve) serves a model instead of training one, behind $LMBOOK_API_KEY
if [ -n "${RUN_SERVE:-}" ]; then set -- serve "$RUN_SERVE" --host 0.0.0.0 --port "${SERVE_PORT:-8000}"; else set -- boot; fi
spend_watch &
G=$!
if [ "${SERVE_ENGINE:-lmbook}" = vllm ] && [ -n "${RUN_SERVE:-}" ]; then
  ( install >> "$L" 2>&1 && { kill "$G" 2>/dev/null; vllm_serve >> "$L" 2>&1; } ) &
else
  ( install >> "$L" 2>&1 && { kill "$G" 2>/dev/null; exec "$V/bin/lmbook" "$@" >> "$L" 2>&1; } ) &
fi
B=$!
"${LMBOOK_START:-/start.sh}" &  # the image's own start script: sshd, JupyterLab, RunPod's proxy
I=$!

wait "$B"
while kill -0 "$I" 2>/dev/null; do wait "$I"; done  # the start script keeps SSH and JupyterLab up until the pod stops
while :; do sleep 3600 & wait $!; done  # an image without one: stay up rather than exit into a restart
