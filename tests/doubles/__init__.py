"""Stand-ins for what cannot run here: the Hugging Face Hub (``hub``), FastDeploy's module chain, whose models
need its compiled HPU ops (``fastdeploy``), and PaddleCustomDevice's legacy converter, which pins an HPU at import
(``legacy_model_convert``). Each is as thin as possible and named for what it stands in for."""
