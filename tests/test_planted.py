"""The planted-depth task (lib/data.planted_images, lib/planted.PlantedTask), the gate spread logged during
training, and --router-lr-scale (psi of reViT's Eq. 1, arXiv 2610.12448, in its own AdamW group).

The task's target is checked against a slow reference written from its definition: each 4x4x3 patch read
pixel by pixel into a vector, f_t(v) = v + W2_t gelu(W1_t LN(v)) applied one step at a time with the layer
norm and GELU written out, then the layer norm of the result. Its table in RESULTS.md: lib/tables.py."""
import json
import math

import pytest
import torch

import revit
import train
from lib import build, data, planted, tables, tasks
from lib.checkpoint import load_model

PLANTED_ARGS = ["--dataset", "planted", "--patch-size", "4", "--depth", "3", "--model-args",
                "dim=48,heads=3,ffn_dim=32", "--batch-size", "32", "--train-subset", "64", "--test-subset", "32",
                "--device", "cpu", "--no-progress", "--log-interval", "1"]


def slow_layer_norm(v: list) -> list:
    mean = sum(v) / len(v)
    var = sum((a - mean) ** 2 for a in v) / len(v)
    return [(a - mean) / math.sqrt(var + 1e-5) for a in v]


def slow_target(image: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, patch: int) -> list:
    """One image (C, H, W) -> per patch (row-major), the list LN(f_L(... f_1(patch vector)))."""
    c, h, w = image.shape
    out = []
    for gy in range(h // patch):
        for gx in range(w // patch):
            v = [float(image[ch, gy * patch + py, gx * patch + px])
                 for ch in range(c) for py in range(patch) for px in range(patch)]
            for t in range(len(w1)):
                u = slow_layer_norm(v)
                hidden = [sum(w1[t, j, i].item() * u[i] for i in range(len(u))) for j in range(w1.shape[1])]
                hidden = [a * 0.5 * (1 + math.erf(a / math.sqrt(2))) for a in hidden]
                v = [v[i] + sum(w2[t, i, j].item() * hidden[j] for j in range(len(hidden))) for i in range(len(v))]
            out.append(slow_layer_norm(v))
    return out


def test_planted_images_are_fixed_bytes_of_the_documented_shape():
    a, b = data.planted_images(100, 20), data.planted_images(100, 20)
    assert a.train.images.shape == (100, 3, 16, 16) and a.test.images.shape == (20, 3, 16, 16)
    assert a.train.images.dtype == torch.uint8 and torch.equal(a.train.images, b.train.images)
    assert torch.equal(a.test.images, b.test.images) and not torch.equal(a.train.images[:20], a.test.images)
    full = data.planted_images(data.PLANTED["train"], data.PLANTED["test"])
    assert torch.equal(full.train.images[:100], a.train.images)  # a subset is a prefix of the same bytes
    assert torch.equal(full.test.images[:20], a.test.images)
    assert (a.num_classes, a.channels, a.image_size) == (0, 3, 16)


def test_the_maps_are_fixed_by_their_seed_and_differ_by_depth():
    m, again, other = (planted.PlantedMaps(48, 4, 16, 1.0, s) for s in (7, 7, 8))
    assert torch.equal(m.w1, again.w1) and torch.equal(m.w2, again.w2)
    assert not torch.equal(m.w1, other.w1)
    x = torch.randn(64, 48)
    single = []  # each map alone: f_t(x), distinct functions of the same input
    for t in range(4):
        one = planted.PlantedMaps(48, 1, 16, 1.0, 7)
        one.w1, one.w2 = m.w1[t:t + 1], m.w2[t:t + 1]
        single.append(one(x))
    for s in range(4):
        for t in range(s):
            assert (single[s] - single[t]).pow(2).mean() > 0.05, (s, t)


def test_patch_tokens_read_each_patch_channel_row_column():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    tokens = planted.patch_tokens(x, 4)
    assert tokens.shape == (2, 4, 48)
    for b in range(2):
        for gy in range(2):
            for gx in range(2):
                want = [x[b, c, gy * 4 + py, gx * 4 + px].item() for c in range(3) for py in range(4) for px in range(4)]
                assert tokens[b, gy * 2 + gx].tolist() == want


def planted_task(model):
    images = data.planted_images(8, 4)
    augment = data.Augment(images, torch.device("cpu"), 0)
    cfg = train.TrainConfig(dataset="planted", eval_batch_size=4)
    return planted.PlantedTask(cfg, images, torch.device("cpu"), augment, lambda: torch.autocast("cpu", enabled=False),
                             model), images


def test_planted_loss_is_the_mse_against_the_slow_composition():
    torch.manual_seed(0)
    model = revit.create_model("revit-mini", image_size=16, patch_size=4, in_channels=3, num_classes=0, dim=48,
                               heads=3, ffn_dim=16, depth=2, num_experts=1)
    task, images = planted_task(model)
    raw = images.train.images[:2]
    loss, parts = task.loss(model, raw, images.train.labels[:2])
    x = (raw.float() / 255 - torch.tensor(images.mean).view(1, 3, 1, 1)) / torch.tensor(images.std).view(1, 3, 1, 1)
    with torch.no_grad():
        tokens = model(x, return_states=True)["tokens"][:, 1:]
    want = torch.tensor([slow_target(x[b], task.maps.w1, task.maps.w2, 4) for b in range(2)])
    assert want.shape == tokens.shape == (2, 16, 48)
    reference = ((tokens - want) ** 2).mean()
    assert torch.allclose(parts["planted"], reference, rtol=1e-4) and torch.allclose(loss, reference, rtol=1e-4)
    # evaluation: the same MSE, image by image, averaged over the test set
    scored = task.evaluate(model, [None], 0, 1)[None]["mse"]
    xt = task.augment.normalise(images.test.images.float() / 255)
    with torch.no_grad():
        tt = model(xt, return_states=True)["tokens"][:, 1:]
    want = torch.tensor([slow_target(xt[b], task.maps.w1, task.maps.w2, 4) for b in range(len(xt))])
    assert scored == pytest.approx(((tt - want) ** 2).mean().item(), rel=1e-4)


def test_planted_needs_its_width_and_patch():
    model = revit.create_model("revit-mini", image_size=16, patch_size=4, in_channels=3, num_classes=0, dim=32,
                               heads=2, ffn_dim=16, depth=2)
    with pytest.raises(SystemExit, match="needs --patch-size 4 and dim=48"):
        planted_task(model)


def eval_records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]


def test_a_planted_run_logs_the_gate_spread_at_every_evaluation(tmp_path):
    out = tmp_path / "run"
    summary = train.main(["--arch", "revit-mini", "--num-experts", "2", *PLANTED_ARGS, "--epochs", "3",
                          "--out-dir", str(out)])
    assert summary["test_mse"] > 0 and summary["reference_depth"] == 3
    records = eval_records(out)
    assert [r["step"] for r in records] == [2, 4]  # every epoch but the last (the final record follows)
    model, _ = load_model(out / "ckpt.pt")
    for r in records:
        assert 0 <= r["gate_spread"] <= 1 and len(r["dominant_expert"]) == 3
    gates = model.gate_matrix().detach()
    assert tasks.gate_summary(model)["gate_spread"] == pytest.approx(float(gates.max() - gates.min()))
    vit = tmp_path / "vit"
    train.main(["--arch", "vit-mini", *PLANTED_ARGS, "--epochs", "2", "--out-dir", str(vit)])
    assert eval_records(vit) and all("gate_spread" not in r for r in eval_records(vit))


# --- --router-lr-scale ---


def old_groups(model, weight_decay):
    """The grouping before psi had a group of its own (the rule of lib/build.param_groups' docstring)."""
    exclude = model.no_weight_decay()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith("bias") and n not in exclude]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def ids(group):
    return [id(p) for p in group["params"]]


def test_router_lr_scale_puts_psi_alone_in_a_third_group():
    model = revit.create_model("revit-mini", num_experts=4)
    same = build.param_groups(model, 0.05, 1.0)
    assert [ids(g) for g in same] == [ids(g) for g in old_groups(model, 0.05)]
    assert all("lr_scale" not in g for g in same)
    groups = build.param_groups(model, 0.05, 10.0)
    assert len(groups) == 3 and groups[2]["lr_scale"] == 10.0 and groups[2]["weight_decay"] == 0.0
    psi = {id(p) for p in model.block.mlp.router.parameters()}
    assert set(ids(groups[2])) == psi and len(psi) == 4  # Linear(1,16) and Linear(16,E): weights, biases
    assert not psi & set(ids(groups[0]) + ids(groups[1]))
    assert sorted(ids(groups[0]) + ids(groups[1]) + ids(groups[2])) == sorted(id(p) for p in model.parameters())
    tied = revit.create_model("revit-mini", num_experts=1)
    assert len(build.param_groups(tied, 0.05, 10.0)) == 2  # no psi
    from lib import moe  # a content router (SMEAR, Table 3) gets the same third group
    smear = moe.create_model("revit-mini-smear")
    router = {id(p) for p in smear.block.mlp.router.parameters()}
    assert set(ids(build.param_groups(smear, 0.05, 30.0)[2])) == router and len(router) == 2


def test_router_lr_scale_trains_psi_at_m_times_the_lr(tmp_path):
    out = tmp_path / "m10"
    train.main(["--arch", "revit-mini", "--num-experts", "2", *PLANTED_ARGS, "--max-steps", "2",
                "--router-lr-scale", "10", "--out-dir", str(out)])
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    groups = ckpt["optimizer"]["param_groups"]
    assert len(groups) == 3 and groups[2]["lr"] == pytest.approx(10 * groups[0]["lr"]) and groups[2]["lr"] > 0
    assert groups[2]["weight_decay"] == 0.0 and groups[0]["lr"] == groups[1]["lr"]


def test_router_lr_scale_one_is_todays_run_and_a_model_without_psi_is_refused(tmp_path):
    base = train.main(["--arch", "revit-mini", "--num-experts", "2", *PLANTED_ARGS, "--max-steps", "3",
                       "--out-dir", str(tmp_path / "a")])
    one = train.main(["--arch", "revit-mini", "--num-experts", "2", *PLANTED_ARGS, "--max-steps", "3",
                      "--router-lr-scale", "1", "--out-dir", str(tmp_path / "b")])
    assert base["test_mse"] == one["test_mse"]
    with pytest.raises(SystemExit, match="--router-lr-scale 10.0: vit-mini has no router"):
        train.main(["--arch", "vit-mini", *PLANTED_ARGS, "--max-steps", "1", "--router-lr-scale", "10",
                    "--out-dir", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match=r"--router-lr-scale must be in \(0, 1,000\]; got 0.0"):
        train.main(["--arch", "revit-mini", *PLANTED_ARGS, "--max-steps", "1", "--router-lr-scale", "0",
                    "--out-dir", str(tmp_path / "d")])
    with pytest.raises(SystemExit, match="--dataset planted is a regression task of its own"):
        train.main(["--arch", "revit-mini", *PLANTED_ARGS, "--max-steps", "1", "--teacher", str(tmp_path / "a" / "ckpt.pt"),
                    "--out-dir", str(tmp_path / "e")])


def test_the_planted_grid_sets_the_untied_vit_against_the_tied_block_too():
    """The planted table (MSE, lower is better) compares every model with E = 1, the untied ViT included; the
    accuracy table leaves the ViT's row without a gap."""
    def stats(mean):
        return {"mean": mean, "std": 0.0, "values": [mean, mean]}
    vit = {"cell": "ViT (untied)", "params": 10, "num_experts": None}
    tied = {"cell": "reViT E=1", "params": 10, "num_experts": 1}
    columns, cells = tables.planted_grid([{**vit, "mse": stats(0.1)}, {**tied, "mse": stats(0.3)}])
    assert len(columns) == len(cells[0]) == 7
    assert [row[3] for row in cells] == ["-0.2000 ± 0.0000", "–"]
    _, cells = tables.GRIDS["experts"]([{**vit, "acc": stats(0.9)}, {**tied, "acc": stats(0.8)}])
    assert [row[3] for row in cells] == ["–", "–"]
