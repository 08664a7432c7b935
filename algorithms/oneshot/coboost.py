"""Co-Boosting (Dai et al., ICLR 2024): DENSE's loop with three changes (card method E).

1. Hard-sample synthesis: the generator's CE term becomes (1 - p_y)^h CE with h = 1, the
   adversarial term is -KL_{T=3}(f_w || s) over all samples (no disagreement mask), no BN term,
   and the generator gradient is clipped at norm 10. As in ``coboost.py`` of the reference,
   the teachers see G(z) without augmentation during synthesis.
2. Ensemble boosting: weights w in [0, 1]^K (start 1/K) take, from the second epoch on, one
   signed-gradient pass over the labelled pool: w <- clip(w - mu delta^e sign(grad), 0, 1),
   mu = 0.01, delta = 0.99, with f_w = sum_k w_k f_k / sum_k w_k.
3. Diverse-sample distillation: each pool batch is perturbed by eta sign(grad_x sum r softmax(f_w/4)),
   r ~ U(-1, 1), eta = 8/255 in input units (the reference adds it to normalised images), then
   KL_{T=4}(f_w || s) with SGD lr 0.01, momentum 0.9, wd 1e-4, cosine over the epochs, batch
   128, student gradient clipped at 10.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.oneshot.datafree import DataFreeConf, DataFreeServer
from fl_platform.algorithms.oneshot.protocol import OneShotClient


@dataclass
class CoBoostConf(DataFreeConf):
    name: str = "oneshot_coboost"
    synthesis_batch_size: int = 128
    synthesis_augment: bool = False
    lambda_bn: float = 0.0
    adv_temperature: float = 3.0
    adv_mask: bool = False
    hard_sample_power: float = 1.0
    generator_clip: float | None = 10.0
    reweight: bool = True
    kd_temperature: float = 4.0
    kd_lr: float = 0.01
    kd_weight_decay: float = 1e-4
    kd_batch_size: int = 128
    kd_cosine: bool = True
    kd_clip: float | None = 10.0
    ods_eta: float = 8.0 / 255.0


SPEC = AlgorithmSpec("oneshot_coboost", CoBoostConf, OneShotClient, DataFreeServer,
                     "Co-Boosting: hard-sample synthesis, ensemble reweighting, diverse-sample distillation")
