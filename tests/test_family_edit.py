

def test_qwen_edit_refuses_caption_dropout_before_any_model_loads():
    from stages.core.config import load_config
    from stages.demo import demo_config
    from stages.families import config_errors

    cfg = load_config(demo_config("qwen-image-edit"), {"model": "unused", "data.caption_dropout": 0.1})
    assert any("'data.caption_dropout' = 0.1" in e and "control images" in e for e in config_errors(cfg))
