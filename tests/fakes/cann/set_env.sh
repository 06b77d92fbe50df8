# Test fake of CANN >= 8.5's /usr/local/Ascend/cann/set_env.sh: the path is what matters, not the contents.
export ASCEND_HOME_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export ASCEND_TOOLKIT_HOME="$ASCEND_HOME_PATH"
