"""Small Chinese and Japanese corpora written for the language tests, with questions whose
relevant document is known (one topic per document, no shared topic words)."""

from __future__ import annotations

ZH_DOCS = {
    "volcano": ("火山", "火山是地壳上的开口，地下的岩浆、火山灰和气体从这里喷出。火山喷发的原因是地下深处的岩浆比周围的岩石轻，"
                "会向上运动并在岩浆房中积聚。当岩浆房里的压力超过上方岩石的强度时，岩浆就冲出地表，形成喷发。"
                "大多数火山位于板块边界，例如环太平洋火山带。"),
    "printing": ("印刷术", "活字印刷术是北宋时期毕昇发明的。他用胶泥制成单个的字模，排版后印刷，印完可以拆开重新使用。"
                 "后来欧洲的古腾堡发明了金属活字印刷机，使书籍的价格大大降低，知识得以广泛传播。"),
    "vaccine": ("疫苗", "疫苗通过让免疫系统提前认识病原体来预防疾病。接种疫苗后，身体会产生抗体和记忆细胞，"
                "以后遇到真正的病毒或细菌时能够迅速反应。天花疫苗是历史上第一种疫苗，由琴纳在十八世纪末研制。"),
    "tea": ("茶", "茶起源于中国西南地区，最早被当作药材使用。唐代陆羽写成《茶经》，系统记载了茶树的种植、采摘和煮茶的方法。"
            "绿茶不经发酵，红茶经过完全发酵，乌龙茶介于两者之间。"),
    "wall": ("长城", "长城是中国古代修建的军事防御工程，主要用于抵御北方游牧民族的侵袭。现存的长城大多修建于明朝，"
             "东起山海关，西至嘉峪关，全长数千公里。长城在一九八七年被列入世界遗产名录。"),
    "panda": ("大熊猫", "大熊猫是生活在中国四川、陕西和甘肃山区的熊科动物。它们几乎只吃竹子，每天要花十多个小时进食。"
              "由于栖息地破碎和繁殖率低，大熊猫曾经濒临灭绝，如今通过保护区的建立数量有所回升。"),
    "photosynthesis": ("光合作用", "光合作用是绿色植物利用阳光，把二氧化碳和水转化为葡萄糖并释放氧气的过程。"
                       "这一过程发生在叶绿体中，叶绿素负责吸收光能。地球大气中的氧气主要来自光合作用。"),
}

ZH_QUESTIONS = {
    "火山为什么会喷发？": "volcano",
    "活字印刷术是谁发明的？": "printing",
    "疫苗如何预防疾病？": "vaccine",
    "绿茶和红茶有什么区别？": "tea",
    "现存的长城大多修建于哪个朝代？": "wall",
    "大熊猫吃什么？": "panda",
    "植物怎样利用阳光制造葡萄糖？": "photosynthesis",
}

JA_DOCS = {
    "volcano": ("火山", "火山は地下のマグマが地表に噴き出してできた地形である。マグマは周りの岩石より軽いため上昇し、"
                "マグマだまりにたまる。圧力が高まると噴火が起こる。日本には百十一の活火山があり、富士山もその一つである。"),
    "sushi": ("寿司", "寿司は酢飯に魚介類などを組み合わせた日本の料理である。もともとは魚を米で発酵させて保存する方法だった。"
              "江戸時代に握り寿司が生まれ、屋台で手軽に食べられるようになった。"),
    "shinkansen": ("新幹線", "新幹線は日本の高速鉄道である。一九六四年の東京オリンピックに合わせて東海道新幹線が開業し、"
                   "東京と大阪を結んだ。最高速度は時速三百キロを超え、大きな事故がほとんどないことで知られる。"),
    "sakura": ("桜", "桜は春に咲く花で、日本では花見の習慣がある。ソメイヨシノは江戸時代末期に生まれた品種で、"
               "各地の公園や学校に植えられている。開花の時期は南から北へと移っていく。"),
    "kanji": ("漢字", "漢字は中国で生まれた文字で、五世紀ごろまでに日本に伝わった。日本語では漢字からひらがなとカタカナが作られ、"
              "現在は三種類の文字を組み合わせて書く。常用漢字は二千百三十六字である。"),
    "earthquake": ("地震", "地震はプレートの境界で岩盤がずれ動くことで起こる揺れである。日本は四つのプレートが接する場所にあり、"
                   "地震が多い。震度は揺れの強さを、マグニチュードは地震の規模を表す。"),
}

JA_QUESTIONS = {
    "火山はなぜ噴火するのか？": "volcano",
    "握り寿司はいつ生まれたか？": "sushi",
    "東海道新幹線はいつ開業したか？": "shinkansen",
    "ソメイヨシノはどんな品種か？": "sakura",
    "ひらがなとカタカナは何から作られたか？": "kanji",
    "マグニチュードは何を表すか？": "earthquake",
}


def documents(table: dict[str, tuple[str, str]]):
    from deepr.records import Document

    return [Document(id=k, title=title, text=text) for k, (title, text) in table.items()]

# The example: three short documents, one question about one of them.
ZH_RUN_DOCS = {k: ZH_DOCS[k] for k in ("volcano", "printing", "vaccine")}
EN_RUN_DOCS = {
    "volcano": ("Volcano", "A volcano is an opening in the crust where magma, ash and gas escape. Volcanoes erupt "
                "because magma deep underground is lighter than the surrounding rock, so it rises and collects in "
                "a magma chamber. When the pressure in the chamber exceeds the strength of the rock above, the "
                "magma breaks through the surface in an eruption. Most volcanoes lie on plate boundaries, such as "
                "the Pacific Ring of Fire."),
    "printing": ("Printing", "Movable type printing was invented by Bi Sheng in the Northern Song dynasty. He made "
                 "single characters of baked clay, set them for printing and reused them afterwards. Later "
                 "Gutenberg built a metal movable type press in Europe, which made books far cheaper."),
    "vaccine": ("Vaccine", "A vaccine prevents disease by teaching the immune system to recognise a pathogen in "
                "advance. After vaccination the body makes antibodies and memory cells that respond quickly to "
                "the real virus or bacterium. The smallpox vaccine, developed by Edward Jenner in the late "
                "eighteenth century, was the first vaccine."),
}


def write_jsonl(path, table: dict[str, tuple[str, str]]):
    import json

    path.write_text("".join(json.dumps({"id": k, "title": t, "text": x}, ensure_ascii=False) + "\n"
                            for k, (t, x) in table.items()), encoding="utf-8")
    return path
