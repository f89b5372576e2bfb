#!/usr/bin/env bash
# Run a built image end to end without a container engine (`podman run` does not work on every
# host, e.g. this one): mount the image read-only and chroot into it, as the image's user, inside
# private mount, network and PID namespaces. The namespaces give the server its own loopback (no
# clash with anything on the host's ports) and take every mount and process with them on exit.
# As in deploy/k8s (readOnlyRootFilesystem + an emptyDir), only /tmp is writable.
#
# Steps, each taken from the image's own config (podman image inspect), not repeated here:
#   1. start ENTRYPOINT + CMD in the background     3. Translate a German sentence with the client
#   2. wait until the HEALTHCHECK command passes    4. read /metrics, check the queue-depth gauge
#   5. SIGTERM (the image's STOPSIGNAL): the server must drain and exit 0 within its grace period
# It also shows that the server needs nothing writable but /tmp.
#
#   deploy/verify-image.sh [IMAGE]        (default localhost/gret-serve:dev; needs root)
set -euo pipefail

STARTUP_SECONDS="${STARTUP_SECONDS:-300}"  # model loading; longer if the image was built with PREPARE_MODELS=0
GRACE_SECONDS="${GRACE_SECONDS:-40}"       # the server's drain grace (30 s) plus a margin, as in k8s

if [[ "${1:-}" != --inside ]]; then
    IMAGE="${1:-localhost/gret-serve:dev}"
    [[ "$(id -u)" == 0 ]] || { echo "verify: needs root (podman image mount, chroot, unshare)" >&2; exit 1; }
    work="$(mktemp -d)"
    mnt="$(podman image mount "$IMAGE")"
    trap 'podman image unmount "$IMAGE" > /dev/null; rm -rf "$work"' EXIT
    # The image's config as shell-quoted arrays: environment, user, workdir, command, health check.
    podman image inspect "$IMAGE" | python3 -c '
import json, shlex, sys
image = json.load(sys.stdin)[0]
c = image["Config"]
test = (image.get("Healthcheck") or c.get("Healthcheck") or {}).get("Test") or []
if not test:
    sys.exit("verify: the image has no HEALTHCHECK (built without --format docker?)")
if test[:1] == ["CMD-SHELL"]:
    test = ["/bin/sh", "-c", test[1]]
elif test[:1] == ["CMD"]:
    test = test[1:]
def array(name, items):
    print(name + "=(" + " ".join(shlex.quote(x) for x in items) + ")")
array("image_env", c.get("Env") or [])
array("image_cmd", (c.get("Entrypoint") or []) + (c.get("Cmd") or []))
array("image_health", test)
print("image_user=" + shlex.quote(c.get("User") or "0:0"))
print("image_workdir=" + shlex.quote(c.get("WorkingDir") or "/"))
print("image_stopsignal=" + shlex.quote(c.get("StopSignal") or "SIGTERM"))
' > "$work/config.sh"
    echo "verify: $IMAGE mounted at $mnt"
    # Not exec: the EXIT trap must unmount the image afterwards.
    unshare --mount --net --pid --fork --propagation private "$0" --inside "$mnt" "$work"
    exit $?
fi

# ---- inside the namespaces ----
mnt="$2"
work="$3"
# Written by the outer half from `podman image inspect`:
image_env=() image_cmd=() image_health=() image_user="" image_workdir="" image_stopsignal=""
# shellcheck source=/dev/null
source "$work/config.sh"
mount -t proc proc "$mnt/proc"
mount -t tmpfs -o mode=1777,size=512m tmpfs "$mnt/tmp"
ip link set lo up

# Run a command in the image, as its user, with its environment and working directory. chroot, env
# and sh all exec, so a background call's $! is the command's own pid (what SIGTERM must reach).
# shellcheck disable=SC2016  # $0 and $@ belong to the inner sh
in_image=(chroot --userspec="$image_user" "$mnt" /usr/bin/env -i "${image_env[@]}" HOME=/tmp
          /bin/sh -c 'cd "$0" && exec "$@"' "$image_workdir")
in_image() { "${in_image[@]}" "$@"; }

if in_image /bin/sh -c 'touch /app/.write-test' 2> /dev/null; then
    echo "verify: FAIL: the image's root filesystem is writable here; the check would not mean much" >&2
    exit 1
fi

log="$work/server.log"
"${in_image[@]}" "${image_cmd[@]}" > "$log" 2>&1 &
server=$!
echo "verify: started ${image_cmd[*]} (pid $server), user $image_user, waiting for health"

started=$SECONDS
until in_image "${image_health[@]}" > /dev/null 2>&1; do
    if ! kill -0 "$server" 2> /dev/null; then
        echo "verify: FAIL: the server exited before it was healthy" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    if ((SECONDS - started > STARTUP_SECONDS)); then
        echo "verify: FAIL: not healthy after ${STARTUP_SECONDS}s" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    sleep 2
done
echo "verify: healthy after $((SECONDS - started))s (${image_health[*]})"

translation="$(in_image python -m server.client --address localhost:50051 translate --to en "Ein Hund läuft.")"
echo "verify: Translate 'Ein Hund läuft.' -> '$translation'"
[[ -n "$translation" ]] || { echo "verify: FAIL: empty translation" >&2; exit 1; }

metrics="$(in_image python -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9090/metrics", timeout=5).read().decode())')"
if ! grep -q '^gret_serve_queue_depth' <<< "$metrics"; then
    echo "verify: FAIL: /metrics has no gret_serve_queue_depth (the HPA's custom metric)" >&2
    exit 1
fi
echo "verify: metrics on :9090: $(grep -c '^gret_serve_' <<< "$metrics") gret_serve_* samples, e.g. $(grep -m1 '^gret_serve_queue_depth' <<< "$metrics")"

# chroot execs the server, so $server is the server process itself.
kill -s "$image_stopsignal" "$server"
stopped=$SECONDS
for ((i = 0; i < GRACE_SECONDS * 10; i++)); do
    kill -0 "$server" 2> /dev/null || break
    sleep 0.1
done
if kill -0 "$server" 2> /dev/null; then
    echo "verify: FAIL: still running ${GRACE_SECONDS}s after $image_stopsignal" >&2
    kill -9 "$server"
    exit 1
fi
rc=0
wait "$server" || rc=$?
echo "verify: $image_stopsignal -> exited with code $rc after $((SECONDS - stopped))s"
echo "verify: last lines of the server's log:"
tail -n 8 "$log" | sed 's/^/    /'
if [[ "$rc" != 0 ]]; then
    echo "verify: FAIL: exit code $rc after $image_stopsignal" >&2
    exit 1
fi
echo "verify: PASS"
