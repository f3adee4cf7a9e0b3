# shellcheck shell=bash
# What sieve's scripts need from the system, each thing checked on its own
# and installed only when it is missing (Debian's packages, as root or with
# sudo). Sourced by scripts/setup.sh and .ci/run.
#
#   need_command COMMAND PACKAGE [APT-OPTION...]
#                                  PACKAGE when COMMAND is not on PATH
#   need_library SONAME PACKAGE    PACKAGE when no library SONAME is installed
#   need_node                      node, then npm, each only when missing
#
# Nothing present is replaced: a machine whose Node.js bundles its own npm
# (NodeSource's, which declares `Conflicts: npm`) keeps both as they are, and
# asking apt for Debian's npm there would fail.

# need_apt PACKAGE [APT-OPTION...]: installs one Debian package (apt-get
# update once per shell, before the first install).
need_apt() {
  local run=()
  [ "$(id -u)" = 0 ] || run=(sudo)
  command -v apt-get >/dev/null || {
    echo "need: $1 is missing and this machine has no apt-get; install it by hand" >&2
    return 1
  }
  export DEBIAN_FRONTEND=noninteractive
  if [ -z "${NEED_APT_UPDATED:-}" ]; then
    ${run[@]+"${run[@]}"} apt-get update -qq
    NEED_APT_UPDATED=1
  fi
  echo "need: installing $1"
  ${run[@]+"${run[@]}"} apt-get install -y -qq "${@:2}" "$1" >/dev/null || {
    echo "need: apt-get could not install $1" >&2
    return 1
  }
}

need_command() {
  command -v "$1" >/dev/null && return 0
  need_apt "${@:2}"
  command -v "$1" >/dev/null || {
    echo "need: $2 is installed but there is still no $1 on PATH" >&2
    return 1
  }
}

# `ldconfig -p` is read whole (no `grep -q`): grep stopping early would kill
# ldconfig with SIGPIPE, and under pipefail a present library would look
# missing. ldconfig lives in /sbin, which a user's PATH may lack.
need_library() {
  local ldconfig
  ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
  "$ldconfig" -p 2>/dev/null | grep -F "$1 " >/dev/null || need_apt "$2"
}

need_node() {
  need_command node nodejs --no-install-recommends
  command -v npm >/dev/null && return 0
  if dpkg-query -W -f='${Conflicts}\n' nodejs 2>/dev/null | tr ',' '\n' | grep -E '^ *npm( |$)' >/dev/null; then
    echo "need: npm is missing beside a Node.js package that conflicts with Debian's npm" \
      "($(dpkg-query -W -f='${Version}' nodejs)); install npm with that Node.js" >&2
    return 1
  fi
  need_apt npm --no-install-recommends
}
