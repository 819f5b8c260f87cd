from ditfuse.runtime import docs


def test_committed_docs_page_in_sync():
    committed = docs.DEFAULT_PATH.read_text()
    assert committed == docs.render(), "docs/fused_kernels.md is stale: run `ditfuse docs` and commit it"


def test_docs_page_content():
    text = docs.render()
    from ditfuse.kernels import registry

    for op in registry.ops():
        assert f"`{op}`" in text
    assert "## Model coverage" in text and "FluxTransformerBlock" in text
    assert "DITFUSE_DISABLE" in text and "DITFUSE_BACKEND" in text
