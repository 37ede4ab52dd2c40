"""The environment pieces: the GPU (nvidia-smi), the torch package (versions, CUDA, NCCL), the tools, and the peak
bf16 throughput that utilisation is measured against."""

import json
import re
import shlex
import shutil
import sys

from .util import ROOT, tail_lines

NVIDIA_SMI_FIELDS = ("name", "memory.total", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem",
                     "clocks.max.mem", "compute_mode", "persistence_mode", "pstate", "temperature.gpu",
                     "power.draw", "power.limit", "pci.bus_id")

# Peak dense bf16 tensor-core TFLOP/s by GPU name, from NVIDIA's datasheets (which print the sparse figure, twice
# these). The first entry whose key the name contains wins, so the specific variants come first. H200 is the H100's
# chip with more and faster memory: the same peak.
PEAK_BF16_TFLOPS = (("H100 NVL", 835), ("H100 PCIe", 756), ("H200 NVL", 835), ("H100", 989), ("H200", 989),
                    ("A100", 312))
PEAK_SOURCE = "datasheet, dense"

TORCH_PROBE = r"""
import importlib.util, json, os, re, sys
spec = importlib.util.find_spec("torch")
root = os.path.dirname(spec.origin) if spec else None
print("TORCH_ROOT=" + (root or ""), flush=True)
info = {"python": sys.version.split()[0], "torch_root": root}
if root:
    try:
        for line in open(os.path.join(root, "version.py")):
            m = re.match(r"^(__version__|cuda)\b[^=]*=\s*['\"]?([^'\"\n]*)", line)
            if m:
                info["file_" + m.group(1).strip("_")] = m.group(2).strip()
    except OSError:
        pass
print("TORCH_FILE_INFO=" + json.dumps(info), flush=True)
import torch
info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
try:
    info["cudnn"] = torch.backends.cudnn.version()
except Exception as e:
    info["cudnn"] = "error: %s" % e
if info["cuda_available"]:
    info["device_count"] = torch.cuda.device_count()
    p = torch.cuda.get_device_properties(0)
    info["device"] = {"name": p.name, "capability": "%d.%d" % (p.major, p.minor),
                      "memory_gib": round(p.total_memory / 2**30, 2), "multiprocessors": p.multi_processor_count}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        info["nccl"] = "error: %s" % e
print("TORCH_INFO=" + json.dumps(info), flush=True)
"""


def peak_bf16_tflops(gpu_name):
    """(peak dense bf16 TFLOP/s, the table's key) for a GPU name as nvidia-smi or torch print it, or (None, None)."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in (gpu_name or "").lower():
            return tflops, key
    return None, None


class Environment:
    """What the machine is: facts (nvidia-smi rows, the configure line), versions (torch's probe), tools, and the
    torch package's directory (for the build and the carried binaries' libraries)."""

    def __init__(self, run):
        self.run = run
        self.facts, self.versions, self.tools = {}, {}, {}
        self.torch_root = ""
        self.peak = None  # {"tflops", "gpu", "key", "source"} once env:peak_tflops ran
        run.add_section("environment", self.summary)

    def gpu_name(self):
        dev = self.versions.get("device") or {}
        smi = self.facts.get("nvidia_smi") or [{}]
        return dev.get("name") or smi[0].get("name")

    def card_gib(self):
        """The GPU's memory in GiB (torch's count, else nvidia-smi's memory.total), or None."""
        dev = self.versions.get("device") or {}
        if dev.get("memory_gib"):
            return float(dev["memory_gib"])
        m = re.match(r"^\s*([\d.]+)\s*MiB", (self.facts.get("nvidia_smi") or [{}])[0].get("memory.total", ""))
        return float(m.group(1)) / 1024 if m else None

    def pieces(self):
        """env:nvidia-smi, env:torch, env:tools."""
        run = self.run

        def smi(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail, None
            gpus = []
            for line in text.splitlines():
                kind, _, row = line.partition(": ")
                fields = {"FULL": NVIDIA_SMI_FIELDS, "MIN": NVIDIA_SMI_FIELDS[:3]}.get(kind)
                if fields and row.count(",") == len(fields) - 1:
                    gpus.append(dict(zip(fields, (c.strip() for c in row.split(",")))))
            self.facts["nvidia_smi"] = gpus
            if not gpus:
                return "fail", "no GPU row in: " + tail_lines(text), None
            g = gpus[0]
            return "pass", "%d GPU(s): %s, %s, driver %s, sm %s/%s, mem %s/%s, %s, persistence %s, power %s of %s" % (
                len(gpus), g["name"], g["memory.total"], g["driver_version"], g.get("clocks.sm"),
                g.get("clocks.max.sm"), g.get("clocks.mem"), g.get("clocks.max.mem"), g.get("compute_mode"),
                g.get("persistence_mode"), g.get("power.draw"), g.get("power.limit")), None

        # The full query, or (should a field be unknown to this driver) the minimal one; then the plain table
        # (other processes, MIG) for check.log.
        query = ('q=$(nvidia-smi --query-gpu="$0" --format=csv,noheader) && printf "%s\\n" "$q" | sed "s/^/FULL: /" '
                 '|| { q=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader) && '
                 'printf "%s\\n" "$q" | sed "s/^/MIN: /"; }; rc=$?; nvidia-smi; exit $rc')
        smi_missing = shutil.which("nvidia-smi", path=run.env.get("PATH")) is None
        run.piece("env:nvidia-smi", ["sh", "-c", query, ",".join(NVIDIA_SMI_FIELDS)], 30, analyze=smi,
                  skip_reason="nvidia-smi not found (no GPU driver here)" if smi_missing and run.dry else None)

        def torch_info(text, rc, killed, status, detail):
            info = {}
            for line in text.splitlines():
                if line.startswith("TORCH_ROOT="):
                    self.torch_root = line.split("=", 1)[1].strip()
                elif line.startswith("TORCH_FILE_INFO=") or line.startswith("TORCH_INFO="):
                    info = json.loads(line.split("=", 1)[1])
            self.versions.update(info)
            if status == "pass":
                dev = info.get("device", {})
                return "pass", "torch %s, CUDA %s, NCCL %s, python %s, cuda available %s%s" % (
                    info.get("torch"), info.get("cuda"), info.get("nccl"), info.get("python"),
                    info.get("cuda_available"), (", %s (sm %s, %s GiB)" % (dev.get("name"), dev.get("capability"),
                                                                          dev.get("memory_gib")) if dev else "")), None
            if run.dry and rc is not None and self.torch_root and "file_version" in info:
                # A CPU-only install of the CUDA wheel cannot import torch (scripts/setup.sh): the build still works.
                return "pass", "torch %s at %s (import failed: %s)" % (
                    info["file_version"], self.torch_root, tail_lines(text, 1, 150)), None
            return status, detail, None

        if run.torch_python:
            run.piece("env:torch", [run.torch_python, "-c", TORCH_PROBE], 120, min_s=10, analyze=torch_info)
        else:
            run.record("env:torch", "fail", 0, "no Python that has torch was found (set PYTHON)")

        tools = ("echo cmake: $(cmake --version | head -n1); echo ninja: $(ninja --version 2>&1); "
                 "echo nvcc: $(nvcc --version 2>&1 | grep -i release); echo cores: $(nproc); "
                 "echo kernel: $(uname -r); echo memory: $(free -g | awk '/Mem:/{print $2 \" GiB\"}'); "
                 "echo disk: $(df -h . | awk 'NR==2{print $4 \" free\"}'); echo python: $(%s --version 2>&1)"
                 % shlex.quote(sys.executable))

        def tool_info(text, rc, killed, status, detail):
            for line in text.splitlines():
                k, sep, v = line.partition(":")
                if sep and k.strip() in ("cmake", "ninja", "nvcc", "cores", "kernel", "memory", "disk", "python"):
                    self.tools[k.strip()] = v.strip()
            return status, ", ".join("%s %s" % kv for kv in self.tools.items())[:300], None

        run.piece("env:tools", ["sh", "-c", tools], 20, min_s=3, analyze=tool_info, cwd=ROOT)

    def peak_piece(self):
        """env:peak_tflops: the peak that measured TFLOP/s are divided by (utilisation). Skipped without a GPU."""
        name = self.gpu_name()
        if not name:
            return self.run.record("env:peak_tflops", "skipped", 0, "no GPU name (nvidia-smi and torch found none): "
                                   "utilisation is not computed")

        def look_up():
            tflops, key = peak_bf16_tflops(name)
            if tflops is None:
                raise RuntimeError("%s is not in the peak table (environment.PEAK_BF16_TFLOPS): add its datasheet's "
                                   "dense bf16 TFLOP/s" % name)
            self.peak = {"tflops": tflops, "gpu": name, "key": key, "source": PEAK_SOURCE}
            return "%s: %d TFLOP/s dense bf16 (%s, as %s)" % (name, tflops, PEAK_SOURCE, key)

        return self.run.func_piece("env:peak_tflops", look_up)

    def summary(self):
        out = {"versions": self.versions, "gpu_facts": self.facts, "tools": self.tools,
               "gpu": bool(self.versions.get("cuda_available") or self.facts.get("nvidia_smi"))}
        if self.peak is not None:
            out["peak_bf16_tflops"] = self.peak
        return out
