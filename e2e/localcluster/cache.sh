# Sourced by build.sh and build-node.sh: the binaries cache under
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/<key>/
# A build writes into a private staging directory and publishes it with one
# rename, .complete inside it, so a directory under its final name is always
# complete, and builds started at the same time (several test runs on one
# machine) never write into each other's files.
cache_root="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}"

# cache_staging BIN: prints a fresh staging directory for BIN.
cache_staging() {
  mkdir -p "$(dirname "$1")"
  local d
  d="$(mktemp -d "$1.partial-XXXXXX")"
  chmod 755 "$d"
  echo "$d"
}

# cache_publish STAGING BIN: marks STAGING complete and renames it to BIN; when
# another build published BIN first, keeps that one and drops STAGING.
cache_publish() {
  local staging="$1" bin="$2"
  touch "$staging/.complete"
  if ! mv -T "$staging" "$bin" 2>/dev/null; then
    if [[ -f "$bin/.complete" ]]; then
      rm -rf "$staging"
    else  # an incomplete directory left under the final name by an older script
      rm -rf "$bin"
      mv -T "$staging" "$bin"
    fi
  fi
}
