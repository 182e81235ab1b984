"""tools/deepgemm_patch.py: the include scan that replaces DeepGEMM's std::regex finds the same includes as the
regex (compiled with the machine's C++ compiler, both on the same texts), and the patch applies once to a tree laid
out as DeepGEMM's."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import deepgemm_patch  # noqa: E402

TEXTS = ['#include <a.h>\nint x;', '#  include\t"b/c.hpp"  // c', '# include <>', '#include <a"', '#define X 1',
         '#include\n<d.h>', '#include <unterminated', '#pragma once\n#include "e.cuh"\n#include <f>\n', '#includex <g>',
         '##include <h>', '']
HARNESS = r'''#include <iostream>
#include <regex>
#include <string>
#include <vector>
static std::vector<std::string> scan(const std::string& code) {
SCAN        return matches;
}
int main() {
    const char* texts[] = {TEXTS};
    for (const char* t: texts) {
        const std::string code(t);
        const std::regex pattern(R"(#\s*include\s*[<"][^>"]+[>"])");
        std::vector<std::string> want;
        for (std::sregex_iterator it(code.begin(), code.end(), pattern), end; it != end; ++ it)
            want.push_back(it->str());
        const auto got = scan(code);
        std::cout << (got == want ? "same " : "DIFFERENT ") << want.size() << "\n";
    }
}
'''
FAKE_PARSER = '''struct Parser {
    static std::vector<std::string> get(const std::string& code) {
        const std::regex pattern(R"(#\\s*include\\s*[<"][^>"]+[>"])");
        std::sregex_iterator iter(code.begin(), code.end(), pattern);
        const std::sregex_iterator end;
        for (; iter != end; ++ iter) {
            const auto include_str = iter->str();
            use(include_str);
        }
    }
};
'''


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_the_scan_finds_what_the_regex_finds(tmp_path):
    scan = deepgemm_patch.SCAN[:deepgemm_patch.SCAN.index("        for (const auto& include_str")]
    source = HARNESS.replace("SCAN", scan).replace("TEXTS", ", ".join(_c_string(t) for t in TEXTS))
    (tmp_path / "h.cpp").write_text(source)
    subprocess.run(["g++", "-std=c++17", "-O0", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")], check=True)
    lines = subprocess.run([str(tmp_path / "h")], capture_output=True, text=True, check=True).stdout.split("\n")[:-1]
    assert len(lines) == len(TEXTS) and all(line.startswith("same ") for line in lines), lines
    assert sum(int(line.split()[1]) for line in lines) == 7  # a.h, b/c.hpp, <a", d.h, e.cuh, f, h


def test_the_patch_applies_once_and_keeps_the_loop_body(tmp_path, capsys):
    (tmp_path / "csrc" / "jit").mkdir(parents=True)
    (tmp_path / "csrc" / "jit" / "include_parser.hpp").write_text(FAKE_PARSER)
    (tmp_path / "setup.py").write_text("cxx_flags = ['-std=c++17', '-O3']\nExt('x', extra_compile_args=cxx_flags)\n")
    assert deepgemm_patch.main([str(tmp_path)]) == 0
    once = [(tmp_path / f).read_text() for f in ("setup.py", "csrc/jit/include_parser.hpp")]
    assert deepgemm_patch.main([str(tmp_path)]) == 0
    assert [(tmp_path / f).read_text() for f in ("setup.py", "csrc/jit/include_parser.hpp")] == once
    assert "std::regex" not in once[1] and "use(include_str);" in once[1] and "matches.push_back" in once[1]
    assert "-fvisibility=hidden" in once[0] and "-Wl,-Bsymbolic" in once[0]
    assert deepgemm_patch.main([str(tmp_path / "missing")]) == 2 and "usage:" in capsys.readouterr().out
