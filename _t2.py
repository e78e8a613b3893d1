import torch, revit, time
from torch.profiler import profile, ProfilerActivity
m = revit.create_model("revit-mini").eval()
x = torch.randn(8,1,28,28)
def peak(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    ev = [e for e in prof.events() if e.name == "[memory]"]
    ev.sort(key=lambda e: e.time_range.start)
    cur = pk = 0
    for e in ev:
        cur += e.cpu_memory_usage; pk = max(pk, cur)
    return pk/2**20, cur/2**20, len(ev)
t=time.time()
with torch.inference_mode():
    print(peak(lambda: m(x)))
    print(peak(lambda: m(x)))
    print(peak(lambda: m(x, depth=12)))
    f = revit.fold(m)
    print(peak(lambda: f(x)))
print(time.time()-t)
