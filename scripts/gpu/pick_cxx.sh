# Sourced by the GPU scripts: export CXX/CC as the first g++ with a shared libstdc++ (setup.py says
# why a static one turns every C++ error in the extension, and in AOTInductor's .so, into a crash).
for _c in ${CXX:-} $(type -ap g++); do
  case "$("$_c" -print-file-name=libstdc++.so 2>/dev/null)" in
    /*) export CXX=$_c CC=${_c%++}cc; break ;;
  esac
done
unset _c
