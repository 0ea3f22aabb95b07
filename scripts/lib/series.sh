# shellcheck shell=bash
# The patch series file (patches/series) shared by vllm-tree, export-patches and apply-patches.sh.
# Source it after pin.sh; it defines functions and runs nothing.
#
# Format (as quilt's and ungoogled-chromium's): one patch file name per line, relative to the
# series file's directory, applied in that order; blank lines and '#' comments are ignored.

SERIES_HEADER='# The patch series against the vLLM release in vllm.pin, applied in this order.
# One patch file name per line, relative to this directory; blank lines and lines that
# start with "#" are ignored. scripts/export-patches rewrites the list below this header
# from the commits of a workspace made by scripts/vllm-tree (keeping the header), and
# scripts/apply-patches.sh applies it to a vLLM checkout or installation.'

read_series() {
  # read_series DIR: set the array SERIES to the absolute paths of the patches listed in
  # DIR/series, in order. Exits 2 where the file or a patch it lists is missing, or a line
  # is not a file name.
  local dir=$1 line n=0 abs
  SERIES=()
  [[ -f $dir/series ]] || die 2 "$dir/series does not exist (a series file lists the patches to apply)"
  abs=$(cd "$dir" && pwd) # git -C and patch -d change directory
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    line=${line%%#*}                                        # comments
    line=${line#"${line%%[![:space:]]*}"}                   # leading blanks
    line=${line%"${line##*[![:space:]]}"}                   # trailing blanks
    [[ -z $line ]] && continue
    [[ $line == *[[:space:]]* ]] &&
      die 2 "$dir/series line $n: '$line' is not one file name (patch options are not supported)"
    [[ -f $dir/$line ]] || die 2 "$dir/series line $n lists $line, but $dir/$line does not exist"
    SERIES+=("$abs/$line")
  done < "$dir/series"
}

series_header() {
  # series_header FILE: print the leading comment block of FILE (up to the first patch name),
  # or the default header where FILE does not exist or has none.
  local file=$1 line header=()
  if [[ -f $file ]]; then
    while IFS= read -r line || [[ -n $line ]]; do
      [[ -n ${line//[[:space:]]/} && $line != \#* ]] && break
      header+=("$line")
    done < "$file"
  fi
  # Drop trailing blank lines so that rewriting the file does not add one each time.
  while ((${#header[@]})) && [[ -z ${header[-1]//[[:space:]]/} ]]; do unset 'header[-1]'; done
  if ((${#header[@]})); then printf '%s\n' "${header[@]}"; else printf '%s\n' "$SERIES_HEADER"; fi
}
