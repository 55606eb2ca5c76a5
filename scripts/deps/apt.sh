# Sourced by scripts/deps/*.sh: `apt_install PKG...` installs Debian packages quietly, running
# `apt-get update` once only when the first try fails (a fresh machine has no package lists).
apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  $sudo apt-get install -y -q "$@" >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "$@" >/dev/null 2>&1; }
}
