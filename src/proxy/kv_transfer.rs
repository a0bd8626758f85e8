//! The bodies of a disaggregated request's two legs, as vLLM's KV connectors
//! (`NixlConnector` and the others a `--kv-transfer-config` names) take them: the
//! prefill engine is asked for one token, whole, with
//! `kv_transfer_params.do_remote_decode`; its answer carries the `kv_transfer_params`
//! (its engine id, blocks, host and port) the decode engine pulls the KV cache with;
//! the decode engine gets the client's request with those params. The same fields and
//! values as vLLM's own router (`vllm-router --vllm-pd-disaggregation`) and its
//! example proxy send (docs/operating.md, "Prefill/decode disaggregation"). Pure: no
//! I/O.

use bytes::Bytes;

use super::edit::append_members;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// What a prefill engine is told: keep the KV cache for a decode engine to pull.
const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// How many answers `body` asks for: its `n` (1 if it names none), times the prompts
/// of a completions batch (`"prompt": ["a", "b"]`; a list of token ids is one prompt).
/// `None` if `body` is not a JSON object serde_json reads, as [`prefill_body`] needs:
/// checked once before the prefill leg, without building its values.
///
/// A prefill's KV cache is pulled once: a request for several answers would have each
/// pull it, and the first to finish frees it under the others (SGLang's router, which
/// also serves vLLM's disaggregation, sends such a request to a decode engine alone).
pub fn fan_out(body: &[u8]) -> Option<Answers> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let answers = serde::Deserializer::deserialize_map(&mut de, FanOut).ok()?;
    de.end().ok()?;
    Some(answers)
}

/// How many answers a request asks for ([`fan_out`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answers {
    /// Its `n` (1 if it names none).
    pub n: u64,
    /// Its prompts: more than one for a batch (`prompt` or `/generate`'s `text` a list
    /// of texts, or `prompt` or `input_ids` a list of token lists).
    pub prompts: u64,
}

impl Answers {
    pub fn total(self) -> u64 {
        self.n.saturating_mul(self.prompts)
    }

    /// How many requests an SGLang engine makes of it, each with a bootstrap room of
    /// its own (as SGLang's router counts them: the prompts of a batch, else `n`); none
    /// for one.
    pub fn batch(self) -> Option<u64> {
        match (self.prompts, self.n) {
            (1, 1) => None,
            (1, n) => Some(n),
            (prompts, _) => Some(prompts),
        }
    }
}

/// Reads [`fan_out`] from an object's `n` and prompts, skipping every other member.
struct FanOut;

impl<'de> serde::de::Visitor<'de> for FanOut {
    type Value = Answers;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Answers, A::Error> {
        let (mut n, mut prompts) = (1, 1);
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "n" => n = map.next_value::<Value>()?.as_u64().unwrap_or(1).max(1),
                "prompt" | "text" | "input_ids" => {
                    let prompt = map.next_value::<&'de RawValue>()?;
                    let items = serde_json::from_str::<Vec<&RawValue>>(prompt.get());
                    let tokens = |items: &[&RawValue]| {
                        items
                            .first()
                            .is_some_and(|i| !i.get().starts_with(['"', '[']))
                    };
                    prompts = match items {
                        Ok(items) if !items.is_empty() && !tokens(&items) => items.len() as u64,
                        _ => 1,
                    };
                }
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(Answers { n, prompts })
    }
}

/// The prefill leg's body: the client's request, answered whole (`stream` false,
/// `stream_options` dropped) with one token (`max_tokens`, and `max_completion_tokens`
/// and `min_tokens` if the client gave them), and the prefill params. `None` if the
/// body is not a JSON object.
pub fn prefill_body(body: &[u8]) -> Option<Bytes> {
    let mut request: Map<String, Value> = serde_json::from_slice(body).ok()?;
    request.insert("stream".into(), Value::Bool(false));
    request.remove("stream_options");
    request.insert("max_tokens".into(), Value::from(1));
    // A client's `max_completion_tokens` would override the one token, and its
    // `min_tokens` above one would make vLLM refuse it.
    for key in ["max_completion_tokens", "min_tokens"] {
        if request.contains_key(key) {
            request.insert(key.into(), Value::from(1));
        }
    }
    let params: Value = serde_json::from_str(PREFILL_PARAMS).ok()?;
    request.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&request).ok().map(Bytes::from)
}

/// What both legs of an SGLang-disaggregated request are told.
#[derive(Debug, Clone, Copy)]
pub struct Bootstrapped<'a> {
    /// The prefill engine's host and bootstrap port (`None`: the engines' default).
    pub host: &'a str,
    pub port: Option<u16>,
    /// One per request the engines make of it.
    pub rooms: &'a [u64],
    /// Whether it is a batch (each member a list, one per request).
    pub batch: bool,
    /// The leg's own data-parallel rank (`routed_dp_rank`), where its node is one.
    pub rank: Option<u32>,
    /// The decode leg's: the data-parallel rank of the prefill engine that holds its
    /// KV cache (`disagg_prefill_dp_rank`), where that node is one.
    pub prefill_rank: Option<u32>,
}

/// A leg's body in SGLang's disaggregation: `body` (a JSON object) with the prefill
/// engine's `bootstrap_host` and `bootstrap_port` (`null`: the engines' default), the
/// request's `bootstrap_room` (a list of each, one per request, for a batch), and the
/// data-parallel ranks, as SGLang's router adds them, as its last members.
pub fn bootstrap_body(body: &[u8], to: &Bootstrapped<'_>) -> Bytes {
    let Bootstrapped {
        host,
        port,
        rooms,
        batch,
        ..
    } = *to;
    let host = Value::from(host).to_string();
    let port = port.map_or_else(|| "null".to_string(), |p| p.to_string());
    let mut members = match (batch, rooms) {
        (false, [room, ..]) => {
            format!(r#""bootstrap_host":{host},"bootstrap_port":{port},"bootstrap_room":{room}"#)
        }
        _ => {
            let each = |v: &str| vec![v; rooms.len()].join(",");
            let rooms = rooms
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            format!(
                r#""bootstrap_host":[{}],"bootstrap_port":[{}],"bootstrap_room":[{rooms}]"#,
                each(&host),
                each(&port)
            )
        }
    };
    if let Some(rank) = to.rank {
        members += &format!(r#","routed_dp_rank":{rank}"#);
    }
    if let Some(rank) = to.prefill_rank {
        members += &format!(r#","disagg_prefill_dp_rank":{rank}"#);
    }
    append_members(body, &[members.as_bytes()])
}

/// The `kv_transfer_params` of a prefill engine's answer, as it wrote them: an
/// object, else `None` (an engine started without a KV connector answers none, or
/// `null`).
pub fn answered_params(answer: &[u8]) -> Option<Box<RawValue>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        kv_transfer_params: Option<Box<RawValue>>,
    }
    let params = serde_json::from_slice::<Answer>(answer)
        .ok()?
        .kv_transfer_params?;
    params.get().trim_start().starts_with('{').then_some(params)
}

/// The decode leg's body: `body` (a JSON object, the client's request as edited for
/// the pool) with `"kv_transfer_params":PARAMS` as its last member, which a JSON
/// reader that keeps the last of a repeated key (Python's, vLLM's) takes over any the
/// client sent.
pub fn decode_body(body: &[u8], params: &RawValue) -> Bytes {
    append_members(body, &[b"\"kv_transfer_params\":", params.get().as_bytes()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_for_one_token_whole_and_keeps_the_cache_for_a_decode_engine() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":500,"max_completion_tokens":500,"min_tokens":20,"temperature":0.2}"#;
        let v = json(&prefill_body(body).unwrap());
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert_eq!(v["min_tokens"], 1);
        assert_eq!(v["temperature"], 0.2);
        assert_eq!(v["messages"][0]["content"], "hi");
        assert_eq!(v["kv_transfer_params"], json(PREFILL_PARAMS.as_bytes()));
        // No max_completion_tokens is added where the client gave none.
        let v = json(&prefill_body(br#"{"prompt":"x"}"#).unwrap());
        assert!(v.get("max_completion_tokens").is_none());
        assert!(v.get("min_tokens").is_none());
        assert_eq!(v["max_tokens"], 1);
        assert!(prefill_body(b"[1]").is_none());
        assert!(prefill_body(b"{").is_none());
        assert_eq!(fan_out(br#"{"a":[1,{"b":"\u00e9"}]}"#).unwrap().total(), 1);
        for not_an_object in [&b"[1]"[..], b"{", b"\"x\"", b"{} {}"] {
            assert_eq!(fan_out(not_an_object), None);
        }
    }

    #[test]
    fn a_request_for_several_answers_is_told_apart() {
        let cases: [(&[u8], u64); 9] = [
            (br#"{"model":"m","messages":[]}"#, 1),
            (br#"{"n":1,"messages":[]}"#, 1),
            (br#"{"messages":[],"n":3}"#, 3),
            (br#"{"n":null}"#, 1),
            (br#"{"prompt":"one"}"#, 1),
            (br#"{"prompt":[1,2,3]}"#, 1),
            (br#"{"prompt":["a","b"],"n":2}"#, 4),
            (br#"{"prompt":[[1,2],[3]]}"#, 2),
            (br#"{"pro\u006dpt":["a","b"]}"#, 2),
        ];
        for (body, answers) in cases {
            let read = fan_out(body).unwrap();
            assert_eq!(read.total(), answers, "{}", String::from_utf8_lossy(body));
        }
        let batch = |b: &[u8]| fan_out(b).unwrap().batch();
        assert_eq!(batch(br#"{"text":"a"}"#), None);
        assert_eq!(batch(br#"{"n":3}"#), Some(3));
        assert_eq!(batch(br#"{"text":["a","b"]}"#), Some(2));
        assert_eq!(batch(br#"{"input_ids":[[1],[2],[3]],"n":2}"#), Some(3));
        assert_eq!(batch(br#"{"input_ids":[1,2,3]}"#), None);
    }

    #[test]
    fn both_sglang_legs_name_the_prefill_engine_s_bootstrap_and_one_room() {
        let body = br#"{"model":"m","bootstrap_room":1,"stream":true}"#;
        let to = Bootstrapped {
            host: "10.0.1.10",
            port: Some(8998),
            rooms: &[42],
            batch: false,
            rank: None,
            prefill_rank: None,
        };
        let out = json(&bootstrap_body(body, &to));
        assert_eq!(out["bootstrap_host"], "10.0.1.10");
        assert_eq!(out["bootstrap_port"], 8998);
        // The last of a repeated key is the one read: the balancer's room.
        assert_eq!(out["bootstrap_room"], 42);
        assert_eq!(out["stream"], true);
        let out = json(&bootstrap_body(
            b"{}",
            &Bootstrapped {
                host: "h\"x",
                port: None,
                rooms: &[7],
                ..to
            },
        ));
        let alone = serde_json::json!({"bootstrap_host": "h\"x", "bootstrap_port": null, "bootstrap_room": 7});
        assert_eq!(out, alone);
        assert!(out.get("routed_dp_rank").is_none());
        let ranked = Bootstrapped {
            rank: Some(3),
            prefill_rank: Some(1),
            ..to
        };
        let out = json(&bootstrap_body(b"{}", &ranked));
        assert_eq!(
            (&out["routed_dp_rank"], &out["disagg_prefill_dp_rank"]),
            (&3.into(), &1.into())
        );
        let batch = Bootstrapped {
            host: "h",
            port: None,
            rooms: &[1, 2],
            batch: true,
            ..to
        };
        let out = json(&bootstrap_body(br#"{"n":2}"#, &batch));
        assert_eq!(out["bootstrap_host"], serde_json::json!(["h", "h"]));
        assert_eq!(out["bootstrap_port"], serde_json::json!([null, null]));
        assert_eq!(out["bootstrap_room"], serde_json::json!([1, 2]));
    }

    #[test]
    fn the_prefill_answer_s_params_are_read_as_written() {
        let answer = br#"{"id":"x","choices":[],"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1,2],"remote_host":"10.0.0.1","remote_port":5600,"do_remote_prefill":true,"do_remote_decode":false}}"#;
        let p = answered_params(answer).unwrap();
        assert!(p.get().contains(r#""remote_block_ids":[1,2]"#));
        assert!(answered_params(br#"{"id":"x"}"#).is_none());
        assert!(answered_params(br#"{"kv_transfer_params":null}"#).is_none());
        assert!(answered_params(br#"{"kv_transfer_params":3}"#).is_none());
        assert!(answered_params(b"not json").is_none());
    }

    #[test]
    fn the_decode_leg_carries_the_params_as_the_body_s_last_member() {
        let params = RawValue::from_string(r#"{"remote_engine_id":"e"}"#.into()).unwrap();
        let body = br#"{"model":"m","kv_transfer_params":{"x":1},"stream":true} "#;
        let out = decode_body(body, &params);
        assert_eq!(
            &out[..],
            br#"{"model":"m","kv_transfer_params":{"x":1},"stream":true,"kv_transfer_params":{"remote_engine_id":"e"}} "#
        );
        // The last of a repeated key is the one read.
        assert_eq!(json(&out)["kv_transfer_params"]["remote_engine_id"], "e");
        assert_eq!(
            &decode_body(b"{ }", &params)[..],
            br#"{ "kv_transfer_params":{"remote_engine_id":"e"}}"#
        );
    }

    proptest::proptest! {
        /// Whatever the client's object (members in any order, spaced or not, a
        /// `kv_transfer_params` of its own), each leg's body is JSON that carries the
        /// leg's params and keeps the client's other members.
        #[test]
        fn both_legs_keep_the_client_s_members_and_carry_their_params(
            members in proptest::collection::btree_map("[a-z_]{1,12}", 0i64..1000, 0..8),
            spaced in proptest::bool::ANY,
            own_params in proptest::bool::ANY,
        ) {
            let mut object: Map<String, Value> =
                members.iter().map(|(k, v)| (k.clone(), Value::from(*v))).collect();
            if own_params {
                object.insert("kv_transfer_params".into(), json(b"{\"x\":1}"));
            }
            let body = match spaced {
                true => serde_json::to_string_pretty(&object).unwrap() + "\n",
                false => serde_json::to_string(&object).unwrap(),
            };
            let params = RawValue::from_string(r#"{"remote_block_ids":[7]}"#.into()).unwrap();
            let decode = json(&decode_body(body.as_bytes(), &params));
            proptest::prop_assert_eq!(&decode["kv_transfer_params"]["remote_block_ids"][0], &Value::from(7));
            let prefill = json(&prefill_body(body.as_bytes()).unwrap());
            proptest::prop_assert_eq!(&prefill["kv_transfer_params"]["do_remote_decode"], &Value::Bool(true));
            proptest::prop_assert_eq!(&prefill["max_tokens"], &Value::from(1));
            for (k, v) in &members {
                let kept = ["stream", "max_tokens", "max_completion_tokens", "min_tokens", "kv_transfer_params"];
                if !kept.contains(&k.as_str()) {
                    proptest::prop_assert_eq!(&decode[k], &Value::from(*v));
                    proptest::prop_assert_eq!(&prefill[k], &Value::from(*v));
                }
            }
        }
    }
}
