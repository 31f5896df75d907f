"""Research in languages written without spaces: BM25 tokens, sentences, passages, the index key."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepr.corpus import open_retriever
from deepr.corpus.chunking import ChunkConfig, chunk_text
from deepr.corpus.tokens import tokenize
from deepr.text.lang import detect_language, write_in
from deepr.text import split_sentences, tok
from lang_corpora import JA_DOCS, JA_QUESTIONS, ZH_DOCS, ZH_QUESTIONS, documents


@pytest.mark.parametrize("docs,questions,lang", [(ZH_DOCS, ZH_QUESTIONS, "zh"), (JA_DOCS, JA_QUESTIONS, "ja")])
def test_bm25_ranks_the_relevant_document_first_for_every_question(docs, questions, lang, tmp_path):
    r = open_retriever(documents(docs), retriever="bm25", cache_dir=tmp_path, progress=False)
    assert r.language == lang and r.describe()["language"] == lang
    for question, want in questions.items():
        hits = r.search(question, k=3)
        assert hits and hits[0].doc_id == want, (question, [h.doc_id for h in hits])


def test_the_whitespace_tokenizer_finds_nothing_in_chinese_the_reason_for_the_segmenter():
    # the English tokenizer reads a Chinese clause as one word, so no query word is ever in a passage
    text, question = ZH_DOCS["volcano"][1], "火山为什么会喷发"
    assert not set(tokenize([question])[0]) & set(tokenize([text])[0])
    assert {"火山", "喷发"} <= set(tokenize([question], "zh")[0]) & set(tokenize([text], "zh")[0])
    assert "为什么" not in tokenize([question], "zh")[0]  # a question word matches every passage


def test_english_tokens_are_the_words_minus_stop_words():
    assert tokenize(["The Eiffel Tower was designed in 1889 by Gustave Eiffel's company."]) == [
        ["eiffel", "tower", "designed", "1889", "gustave", "eiffel", "s", "company"]]


def test_japanese_tokens_are_bigrams_within_one_script():
    toks = tokenize(["東京タワーは赤い。"], "ja")[0]
    assert "東京" in toks and "タワ" in toks and "ワー" in toks
    assert "京タ" not in toks  # no bigram across a change of script


def test_language_detection():
    assert detect_language(ZH_DOCS["tea"][1]) == "zh"
    assert detect_language(JA_DOCS["sushi"][1]) == "ja"
    assert detect_language("ภูเขาไฟระเบิดเพราะแมกมา") == "th"
    assert detect_language("Tokyo (東京) is the capital of Japan and its largest city.") == "en"


def test_the_index_key_records_the_language_and_english_keys_are_unchanged(tmp_path):
    zh = open_retriever(documents(ZH_DOCS), retriever="bm25", cache_dir=tmp_path, progress=False)
    bigram = open_retriever(documents(ZH_DOCS), retriever="bm25", cache_dir=tmp_path, progress=False,
                            language="ja")
    assert zh.path != bigram.path and bigram.language == "ja"
    from deepr.corpus.index import index_key

    p = zh.passages
    assert index_key("c", p, "m", ChunkConfig()) == index_key("c", p, "m", ChunkConfig(), language="en")
    assert index_key("c", p, "m", ChunkConfig()) != index_key("c", p, "m", ChunkConfig(), language="zh")
    with pytest.raises(ValueError, match="--language 'klingon'"):
        open_retriever(documents(ZH_DOCS), retriever="bm25", cache_dir=tmp_path, progress=False, language="klingon")


def test_chinese_sentences_end_at_their_own_full_stops_with_their_citations():
    text = "岩浆比岩石轻，会向上运动[N1-R1]。压力超过岩石强度时就会喷发！为什么？因为……气体膨胀。「这是引用。」最后一句[2]"
    assert split_sentences(text) == ["岩浆比岩石轻，会向上运动[N1-R1]。", "压力超过岩石强度时就会喷发！", "为什么？",
                                     "因为……", "气体膨胀。", "「这是引用。」", "最后一句[2]"]
    assert split_sentences("火山はなぜ噴火するのか？マグマが上昇するからです。Dr. Smith agreed. Then it ended.") == [
        "火山はなぜ噴火するのか？", "マグマが上昇するからです。", "Dr. Smith agreed.", "Then it ended."]


def test_english_sentences_unchanged():
    text = "Dr. Smith met Mr. Jones, e.g. at 5 p.m. on Main St. yesterday. It rained! Was it cold? Yes."
    assert split_sentences(text) == ["Dr. Smith met Mr. Jones, e.g. at 5 p.m. on Main St. yesterday.",
                                     "It rained!", "Was it cold?", "Yes."]


def test_chinese_passages_are_cut_by_characters_on_sentence_ends():
    sentence = "火山是地壳上的开口，岩浆和气体从这里喷出。"  # 21 characters
    chunks = chunk_text(sentence * 10, ChunkConfig(max_words=50, overlap=0))
    assert len(chunks) == 5 and all(c == sentence * 2 for c in chunks)  # whole sentences, no spaces added
    long = "岩" * 130  # one sentence longer than a window: windows of characters
    assert [len(c) for c in chunk_text(long, ChunkConfig(max_words=50, overlap=10))] == [50, 50, 50]


def test_english_passages_keep_every_character():
    text = 'He called it "naive art." "Folk art" is not used there. See the pair (eye.) Players score.'
    assert chunk_text(text) == [text]


def test_tok_finds_chinese_content_words():
    assert tok("火山为什么会喷发[N1-R1]。") == {"火山", "喷发"}
    assert tok("Volcanoes erupt [1].") == {"volcanoes", "erupt"}


def test_prompts_ask_for_the_question_language_and_english_prompts_stay_the_same():
    assert "Chinese" in write_in("火山为什么会喷发？") and "Japanese" in write_in("火山はなぜ噴火するのか？")
    assert write_in("Why do volcanoes erupt?") == ""


# --- a multilingual embedder's query/passage prompts -------------------------------------------


@pytest.fixture(scope="module")
def prompted_model(tmp_path_factory):
    """A tiny BERT sentence-transformers folder whose config names e5-style prompts."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizer

    root = tmp_path_factory.mktemp("st")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "query", "passage", ":", "火", "山", "喷", "发", "lava", "hot"]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(root / "bert")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root / "bert")
    st = SentenceTransformer(modules=[Transformer(str(root / "bert")), Pooling(32, "mean")],
                             prompts={"query": "query: ", "passage": "passage: "}, device="cpu")
    st.save(str(root / "model"))
    # the pooling config in the older keys the packaged MiniLM ships
    (root / "model" / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}), encoding="utf-8")
    return root / "model", SentenceTransformer(str(root / "model"), device="cpu")


def test_the_embedder_passes_the_model_prompts_to_queries_and_passages(prompted_model):
    from deepr.corpus.embed import Embedder, model_prompts

    path, st = prompted_model
    assert model_prompts(str(path)) == {"query": "query: ", "passage": "passage: "}
    emb = Embedder(str(path), precision="fp32", use="index")
    assert "prompts-" in emb.name  # the index key changes with the prompts

    def unit(v):
        v = np.asarray(v, dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    texts = ["火山喷发", "lava hot"]
    q, p = emb.encode(texts), emb.encode_passages(texts)
    assert np.allclose(q, unit(st.encode(texts, prompt_name="query")), atol=1e-4)
    assert np.allclose(p, unit(st.encode(texts, prompt_name="passage")), atol=1e-4)
    assert not np.allclose(q, unit(st.encode(texts)), atol=1e-3)  # the prompt is really there


def test_e5_models_get_their_family_prompts_and_others_none(tmp_path):
    from deepr.corpus.embed import model_prompts

    assert model_prompts("intfloat/multilingual-e5-small") == {"query": "query: ", "passage": "passage: "}
    assert model_prompts("BAAI/bge-m3") == {} and model_prompts("all-MiniLM-L6-v2") == {}


def test_a_long_chinese_brief_is_shortened_for_titles_and_focused_for_search():
    from deepr.evidence.extract import focus_query, shorten

    brief = "请撰写一份关于火山的研究报告。" + "报告需要覆盖火山的形成、分布和危害，并引用可靠的资料。" * 6 + "火山为什么会喷发？"
    title = shorten(brief, 16)
    assert title.endswith("…") and len(title) <= 26 and title.startswith("请撰写一份关于火山")
    assert focus_query(brief) == "火山为什么会喷发？"  # the brief's question, not all of it
    assert shorten("Why do volcanoes erupt at plate boundaries", 4) == "Why do volcanoes erupt …"


def test_the_citation_check_reads_chinese_claims_one_sentence_at_a_time():
    import asyncio

    from deepr.agent.support import check_support

    sources = {"N1-R1": "火山喷发的原因是地下深处的岩浆比周围的岩石轻，会向上运动并在岩浆房中积聚。"}
    report = ("# 火山为什么会喷发\n\n## 回答\n\n火山喷发的原因是岩浆比周围的岩石轻[N1-R1]。大熊猫几乎只吃竹子[N1-R1]。\n\n"
              "## 参考文献\n\n- [N1-R1] 火山: “…”\n")
    rows = asyncio.run(check_support(report, sources)).rows
    assert [(r["text"], r["verdict"]) for r in rows] == [("火山喷发的原因是岩浆比周围的岩石轻。", "supported"),
                                                          ("大熊猫几乎只吃竹子。", "unsupported")]


def test_search_on_the_command_line_takes_a_language_and_refuses_an_unknown_one(tmp_path):
    from typer.testing import CliRunner

    from deepr.cli import app
    from lang_corpora import write_jsonl

    corpus = write_jsonl(tmp_path / "zh.jsonl", ZH_DOCS)
    args = ["search", "活字印刷术是谁发明的", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "c"), "-r", "bm25",
            "--json", "-k", "1"]
    for lang in ("auto", "zh", "ja"):  # jieba words or character bigrams: the printing document either way
        r = CliRunner().invoke(app, [*args, "--language", lang])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)[0]["doc_id"] == "printing"
    r = CliRunner().invoke(app, [*args, "--language", "xx"])
    assert r.exit_code == 2 and "--language 'xx'" in r.output
