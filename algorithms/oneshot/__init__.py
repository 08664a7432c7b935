"""One-shot federated learning (specs/oneshot.md): clients train once, upload once.

Every method shares one protocol (:mod:`.protocol`): the clients train from the common
initial weights for many local epochs and upload their full weights once; the server half
runs in list mode (it receives every client model in client-id order) and builds the final
model. Client models are cached on disk per (seed, partition, local-training settings) so that
every server-side method below is compared on the very same client models.

Server-side methods, one module each:

* :mod:`.fedavg`   ``oneshot_fedavg``: parameter averaging (and, with ``rounds > 1``, plain
  multi-round FedAvg, the reference with the same total local epochs).
* :mod:`.ensemble` ``oneshot_ensemble``: the logit ensemble, the upper reference.
* :mod:`.feddf`    ``oneshot_feddf``: ensemble distillation on held-out unlabelled server data.
* :mod:`.dense`    ``oneshot_dense``: data-free distillation through a generator (DENSE).
* :mod:`.coboost`  ``oneshot_coboost``: DENSE plus hard samples, ensemble reweighting and
  diverse-sample distillation (Co-Boosting).
* :mod:`.adi`      ``oneshot_adi``: data-free distillation through input optimisation (Fed-ADI:
  Adaptive DeepInversion of the client ensemble), the baseline of DENSE's and FuseFL's tables.

Shared building blocks: :mod:`.distill` (KD loss, predictions), :mod:`.datafree` (the
synthesise-then-distil loop all three data-free methods share, and the generator of DENSE and
Co-Boosting).
"""
