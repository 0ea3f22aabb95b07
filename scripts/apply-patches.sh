#!/usr/bin/env bash
# Apply the patch series to a vLLM installation or checkout, all or nothing.
#
#   scripts/apply-patches.sh [--check] [--patches DIR] TARGET
#
# TARGET is a directory holding the vllm/ package: a site-packages directory (patched with
# GNU patch; git is not needed) or a vLLM git checkout such as a workspace made by
# scripts/vllm-tree (each patch becomes a commit, with git am, whose committer date is the
# day of the patch's Last-Update header, so that scripts/export-patches writes it back as is).
#
#   --check        check only: report what would be done, change nothing
#   --patches DIR  apply DIR/series, whose patches are in DIR (default: patches/)
#
# TARGET must have the vLLM version of vllm.pin. Every patch is tried first, in order, on a
# scratch copy of the files the series touches, exactly (no fuzz); TARGET is changed only when
# all of them apply. A TARGET that already has the whole series is left alone.
#
# Exit codes: 0 applied, already patched, or nothing to apply (with --check: would apply);
# 1 a patch does not apply (or, in a git checkout, the files it touches have uncommitted
# changes); 2 usage or setup error (bad arguments, a broken series, GNU patch or git missing);
# 3 TARGET has no vllm/ package, or a vLLM version other than vllm.pin's;
# 4 TARGET is partly patched (some patches of the series applied, some not).
# Nothing in TARGET is changed unless the exit code is 0.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/pin.sh
. "$here/lib/pin.sh"
# shellcheck source-path=SCRIPTDIR source=lib/series.sh
. "$here/lib/series.sh"

# --help prints the comment block at the top of this file.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
check=0 patches=$EO_ROOT/patches target=
while (($#)); do
  case $1 in
    --check) check=1; shift ;;
    --patches) [[ $# -ge 2 ]] || die 2 "--patches needs a directory"; patches=${2%/}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) die 2 "unknown option '$1' (see --help)" ;;
    *) [[ -z $target ]] || die 2 "one TARGET only (see --help)"; target=${1%/}; shift ;;
  esac
done
[[ -n $target ]] || die 2 "which TARGET? (a site-packages directory or a vLLM checkout; see --help)"
[[ -d $target ]] || die 2 "$target is not a directory"
series_file=$patches/series
[[ $series_file == "$EO_ROOT"/* ]] && series_file=${series_file#"$EO_ROOT"/}

# --- which vLLM is it? ---------------------------------------------------------------------
[[ -d $target/vllm ]] ||
  die 3 "$target has no vllm/ package: pass the site-packages directory that vLLM is" \
    "installed in, or a vLLM checkout"
git_target=0
if [[ -e $target/.git ]]; then
  command -v git > /dev/null || die 2 "$target is a git checkout, but git is not installed"
  git_target=1
fi

target_version() {
  # The first of: vllm/_version.py, a vllm-*.dist-info/METADATA, the nearest v*/upstream-v* tag.
  local metadata version_py=$target/vllm/_version.py
  if [[ -f $version_py ]]; then
    sed -n "/^__version__[[:space:]]*=/{s/.*['\"]\([^'\"]*\)['\"].*/\1/p;q;}" "$version_py"
    return
  fi
  for metadata in "$target"/vllm-*.dist-info/METADATA; do
    if [[ -f $metadata ]]; then
      sed -n '/^Version:/{s/^Version:[[:space:]]*//;s/\r$//;p;q;}' "$metadata"
      return
    fi
  done
  if ((git_target)); then
    { git -C "$target" describe --tags --abbrev=0 --match 'v[0-9]*' --match 'upstream-v[0-9]*' ||
      true; } 2> /dev/null | sed 's/^upstream-//; s/^v//'
  fi
}
version=$(target_version)
[[ -n $version ]] || die 3 "cannot tell which vLLM $target has: it has no vllm/_version.py," \
  "no vllm-*.dist-info/METADATA and no v$PIN_VLLM_VERSION tag"
# A local version label (0.29.0+cu129) marks a build variant of the same Python sources.
[[ ${version%%+*} == "$PIN_VLLM_VERSION" ]] ||
  die 3 "$target has vLLM $version, this series is for vLLM $PIN_VLLM_VERSION (vllm.pin);" \
    "install vLLM $PIN_VLLM_VERSION there, or use a series made for $version"

# --- the series ------------------------------------------------------------------------------
read_series "$patches"
n=${#SERIES[@]}
if ((n == 0)); then
  echo "nothing to apply: $series_file lists no patches"
  exit 0
fi
command -v patch > /dev/null || die 2 "GNU patch is needed (install the 'patch' package)"
unset POSIXLY_CORRECT # it would switch GNU patch to POSIX rules (backups, file name choice)

touched_files() {
  # The files a git-style patch changes, from the ---/+++ lines of each file header (and the
  # "diff --git a/X b/X" line, for a mode-only change that has no ---/+++ lines).
  awk '
    /^diff / { header = 1; s = substr($0, 12); h = (length(s) - 1) / 2
               if ($2 == "--git" && h == int(h) && substr(s, 3, h - 2) == substr(s, h + 4))
                 print substr(s, 3, h - 2)
               next }
    /^@@ / { header = 0 }
    header && /^(---|\+\+\+) / { p = substr($0, 5); sub(/\t.*/, "", p)
                                 if (p != "/dev/null") { sub(/^[^\/]*\//, "", p); print p } }
  ' "$@"
}
touched=()
for p in "${SERIES[@]}"; do
  files=$(touched_files "$p")
  [[ -n $files ]] || die 2 "$p changes no file that can be found (is it a git-style patch?)"
  while IFS= read -r f; do
    # The series is applied to installed packages too: it may change the vllm package only.
    [[ $f == vllm/* && /$f/ != */../* ]] ||
      die 2 "$p changes $f, which is outside vllm/; the series may change only the vllm package"
    touched+=("$f")
  done <<< "$files"
done
mapfile -t touched < <(printf '%s\n' "${touched[@]}" | sort -u)

# --- dry runs on a scratch copy ----------------------------------------------------------------
scratch=$(mktemp -d "${TMPDIR:-/tmp}/apply-patches.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

copy_touched() {
  # copy_touched DEST: copy the touched files of TARGET, as they are now, into an empty DEST.
  local dest=$1 f
  rm -rf "$dest" && mkdir -p "$dest"
  for f in "${touched[@]}"; do
    [[ -e $target/$f ]] || continue
    mkdir -p "$dest/$(dirname "$f")" && cp -p "$target/$f" "$dest/$f"
  done
}

gnu_patch() {
  # gnu_patch DIR PATCH [OPTION...]: exact (no fuzz; offsets are fine), never reverse on a
  # guess (--forward), and leave no .orig or .rej file behind.
  local dir=$1 file=$2
  shift 2
  patch -d "$dir" -p1 --fuzz=0 --forward --batch --no-backup-if-mismatch --reject-file=- \
    --quoting-style=literal "$@" -i "$file"
}

try_patches() {
  # try_patches apply|undo INDEX...: on a fresh scratch copy, apply or undo the patches
  # SERIES[INDEX...] one after another, for real, since each may build on the one before.
  # On a failure set failed_patch and failed_output, and return 1.
  local options=() i
  [[ $1 == undo ]] && options=(-R)
  shift
  copy_touched "$scratch/tree"
  for i in "$@"; do
    if ! failed_output=$(gnu_patch "$scratch/tree" "${SERIES[i]}" "${options[@]}" 2>&1); then
      failed_patch=${SERIES[i]}
      return 1
    fi
  done
}

failed_files() {
  # failed_files OUTPUT: the files that GNU patch's OUTPUT names next to a failure.
  awk '
    /^(patching|checking) file / { f = substr($0, index($0, "file ") + 5) }
    /^The next patch.* the file / { f = substr($0, index($0, "the file ") + 9); sub(/,$/, "", f) }
    /^\|--- [^\/]*\// { f = substr($0, 6); sub(/^[^\/]*\//, "", f); sub(/\t.*/, "", f) }
    /FAILED|ignored|can.t find file|not supported/ && f != "" && !seen[f]++ {
      list = list (list == "" ? "" : ", ") f }
    END { print list }
  ' <<< "$1"
}

name() { basename "$1"; }
forward=() backward=() # 0 1 ... n-1 and n-1 ... 1 0
for ((i = 0; i < n; i++)); do forward+=("$i") backward=("$i" "${backward[@]}"); done
if try_patches apply "${forward[@]}"; then
  state=unapplied
else
  first_failure=$failed_patch first_output=$failed_output
  if try_patches undo "${backward[@]}"; then
    state=applied
  else
    state=neither
  fi
fi

if [[ $state == applied ]]; then
  echo "already patched: $n patches of $series_file are applied to $target"
  exit 0
elif [[ $state == neither ]]; then
  # Partly patched? Look for the longest applied prefix of the series, then, where there is
  # none, for single patches that undo cleanly (a mixture).
  looks_applied=()
  for ((j = n - 1; j >= 1; j--)); do
    if try_patches undo "${backward[@]:n-j}"; then
      for ((i = 0; i < j; i++)); do looks_applied+=("$(name "${SERIES[i]}")"); done
      break
    fi
  done
  if ((${#looks_applied[@]} == 0)); then
    for ((i = 0; i < n; i++)); do
      if try_patches undo "$i"; then looks_applied+=("$(name "${SERIES[i]}")"); fi
    done
  fi
  if ((${#looks_applied[@]})); then
    die 4 "$target is partly patched: ${#looks_applied[@]} of the $n patches of $series_file" \
      "look applied (${looks_applied[*]}), the others do not; nothing was changed." \
      "Start again from a pristine vLLM $PIN_VLLM_VERSION (reinstall it, or check out its tag)"
  fi
  printf 'GNU patch said, on a scratch copy:\n    %s\n' "${first_output//$'\n'/$'\n    '}" >&2
  files=$(failed_files "$first_output")
  [[ -z $files ]] || files=" (failed in $files)"
  die 1 "$(name "$first_failure") of $series_file does not apply to $target$files;" \
    "nothing was changed. Is it vLLM $PIN_VLLM_VERSION as released, or does the patch need" \
    "refreshing in a workspace (scripts/vllm-tree)?"
fi

# --- apply -------------------------------------------------------------------------------------
if ((git_target)); then
  gitdir=$(git -C "$target" rev-parse --absolute-git-dir)
  [[ -e $gitdir/rebase-apply || -e $gitdir/rebase-merge ]] &&
    die 1 "$target has a git am or rebase in progress; finish or abort it first"
  git -C "$target" diff --cached --quiet ||
    die 1 "$target has staged changes; commit or unstage them first (git am needs a clean index)"
  dirty=$(git -C "$target" status --porcelain --untracked-files=all -- "${touched[@]}")
  [[ -z $dirty ]] || die 1 "$target has uncommitted changes in files the series touches;" \
    "commit or stash them first:"$'\n'"$dirty"
fi
if ((check)); then
  echo "would apply $n patches of $series_file to $target"
  exit 0
fi

if ((git_target)); then
  ident=()
  git -C "$target" config user.name > /dev/null || ident+=(-c user.name=apply-patches)
  git -C "$target" config user.email > /dev/null ||
    ident+=(-c user.email=apply-patches@vllm-expert-offload.invalid)
  orig=$(git -C "$target" rev-parse HEAD)
  for ((i = 0; i < n; i++)); do
    echo "* Applying $(name "${SERIES[i]}") ($((i + 1))/$n)"
    # Last-Update (DEP-3, in the mail header: up to the first empty line) dates the commit.
    updated=$(sed -n '/^$/q; s/^Last-Update: *\([0-9]\{4\}-[0-9]\{2\}-[0-9]\{2\}\) *$/\1/p' \
      "${SERIES[i]}")
    dated=()
    [[ -z $updated ]] || dated=(env "GIT_COMMITTER_DATE=${updated}T00:00:00+00:00")
    # Exactly as written: no three-way merge, whitespace as it is, subject brackets kept
    # (only "[PATCH]" is dropped), whatever am.* or apply.* the user has configured.
    if ! "${dated[@]}" git -C "$target" "${ident[@]}" am --quiet --no-3way --keep-non-patch \
      --no-scissors --no-message-id --no-keep-cr --whitespace=nowarn "${SERIES[i]}"; then
      git -C "$target" am --abort 2> /dev/null || true
      git -C "$target" reset --quiet --keep "$orig"
      die 1 "git am failed on $(name "${SERIES[i]}"); $target is back at its original commit"
    fi
  done
else
  # Keep a copy of what the series touches, to put back if a patch fails after all (the
  # dry run passed, so only an I/O error or a concurrent change could make it fail).
  copy_touched "$scratch/backup"
  for ((i = 0; i < n; i++)); do
    echo "* Applying $(name "${SERIES[i]}") ($((i + 1))/$n)"
    if ! out=$(gnu_patch "$target" "${SERIES[i]}" 2>&1); then
      printf '%s\n' "$out" >&2
      for f in "${touched[@]}"; do
        rm -f "$target/$f"
        [[ ! -e $scratch/backup/$f ]] || cp -p "$scratch/backup/$f" "$target/$f"
      done
      die 1 "$(name "${SERIES[i]}") failed on $target after the dry run had passed;" \
        "its files are as they were before"
    fi
  done
fi
echo "applied $n patches of $series_file to $target"
