"""The training script's pieces that the shipped artifact depends on."""

import numpy as np

from guardrails.detectors.injection_ensemble import InjectionEnsemble
from guardrails.train_injection import USE_SEEDS, _fit


def test_the_bagged_network_is_the_mean_of_its_members_and_serves_as_one():
    """The USE component is several networks from different random starts; the artifact stores
    them as one wider network, which must score exactly the mean of the members' logits, and
    the ensemble's serving code (``score_use``) must read it unchanged."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 16)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] + rng.normal(size=120) > 0).astype(np.int64)
    bagged = _fit("use", x, y, 0.1)
    assert bagged.coefs_[0].shape == (16, 256 * USE_SEEDS)

    from sklearn.neural_network import MLPClassifier

    def logit(net):  # the output unit before its sigmoid
        hidden = np.maximum(x @ net.coefs_[0] + net.intercepts_[0], 0.0)
        return (hidden @ net.coefs_[1] + net.intercepts_[1]).ravel()

    members = [
        MLPClassifier(hidden_layer_sizes=(256,), alpha=0.1, max_iter=300, random_state=seed).fit(x, y)
        for seed in range(USE_SEEDS)
    ]
    for m in members:  # the logit read off the weights is the members' own
        assert np.allclose(1 / (1 + np.exp(-logit(m))), m.predict_proba(x)[:, 1], atol=1e-6)
    mean_logit = np.mean([logit(m) for m in members], axis=0)
    assert np.allclose(logit(bagged), mean_logit, atol=1e-4)
    # The members really differ: bagging them is not a no-op.
    assert np.ptp([logit(m) for m in members], axis=0).max() > 1e-2

    ensemble = InjectionEnsemble(
        components=("use",),
        minilm=None,
        use_hidden_weights=bagged.coefs_[0].astype(np.float32),
        use_hidden_bias=bagged.intercepts_[0].astype(np.float32),
        use_weights=bagged.coefs_[1][:, 0].astype(np.float32),
        use_bias=float(bagged.intercepts_[1][0]),
        char_weights=None,
        char_bias=0.0,
        stack_weights=np.ones(1, dtype=np.float32),
        stack_bias=0.0,
    )
    assert np.allclose(ensemble.score_use(x), bagged.predict_proba(x)[:, 1], atol=1e-5)
