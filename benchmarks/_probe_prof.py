import sys, torch, cProfile, pstats, io
from common import mlp, run_point, save_row
from pipeengine import PipelineEngine
import torch.distributed as dist

def worker(schedule, width, path):
    engine = PipelineEngine(mlp(width, 8), torch.nn.functional.mse_loss, num_microbatches=8, schedule=schedule, partition="uniform")
    x, y = torch.randn(256, width), torch.randn(256, width)
    step = lambda: engine.train_step(x if engine.first else None, y if engine.last else None)
    for _ in range(5): step()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(50): step()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    out = s.getvalue()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35)
    out += s.getvalue()
    with open(path + f".{dist.get_rank()}", "w") as f: f.write(out)
    if dist.get_rank() == 0: save_row(path, 1)

if __name__ == "__main__":
    import tempfile, os
    d = tempfile.mkdtemp(); p = os.path.join(d, "x")
    from pipeengine import launch
    launch(worker, 2, args=(sys.argv[1], int(sys.argv[2]), p), threads=1)
    print(open(p + ".1").read())
