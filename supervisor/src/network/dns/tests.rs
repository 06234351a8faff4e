use super::*;
use proptest::prelude::*;

const ID: u16 = 0x1234;
const NOERROR: u16 = 0x8180;
const TO_QUESTION: [u8; 2] = [0xc0, 12];

fn reply(id: u16, flags: u16, qname: &str, qtype: QType, answers: &[Vec<u8>]) -> Vec<u8> {
    let mut msg = [id.to_be_bytes(), flags.to_be_bytes(), [0, 1]].concat();
    msg.extend(u16::try_from(answers.len()).unwrap().to_be_bytes());
    msg.extend([0; 4]);
    msg.extend(encode_name(qname).unwrap());
    msg.extend(qtype.code().to_be_bytes());
    msg.extend(CLASS_IN.to_be_bytes());
    answers.iter().for_each(|answer| msg.extend(answer));
    msg
}

fn record(owner: &[u8], rtype: u16, class: u16, rdata: &[u8]) -> Vec<u8> {
    let mut record = [owner, &rtype.to_be_bytes(), &class.to_be_bytes(), &[0, 0, 0, 60]].concat();
    record.extend(u16::try_from(rdata.len()).unwrap().to_be_bytes());
    record.extend(rdata);
    record
}

fn a(owner: &[u8], ip: [u8; 4]) -> Vec<u8> {
    record(owner, QType::A.code(), CLASS_IN, &ip)
}

fn cname(owner: &[u8], target: &str) -> Vec<u8> {
    record(owner, TYPE_CNAME, CLASS_IN, &encode_name(target).unwrap())
}

fn wire(name: &str) -> Vec<u8> {
    encode_name(name).unwrap()
}

#[test]
fn a_and_aaaa_answers() {
    let msg = reply(ID, NOERROR, "example.com", QType::A, &[a(&TO_QUESTION, [93, 184, 215, 14])]);
    let found = parse_response(ID, "Example.COM.", QType::A, &msg).unwrap();
    assert_eq!(found, [IpAddr::from([93, 184, 215, 14])]);
    let six = [0x20, 1, 0x48, 0x60, 0x48, 0x60, 0, 0, 0, 0, 0, 0, 0, 0, 0x88, 0x88];
    let answer = record(&TO_QUESTION, QType::Aaaa.code(), CLASS_IN, &six);
    let msg = reply(ID, NOERROR, "example.com", QType::Aaaa, &[answer]);
    assert_eq!(parse_response(ID, "example.com", QType::Aaaa, &msg).unwrap(), [IpAddr::from(six)]);
}

#[test]
fn cname_chain_is_followed_and_other_owners_ignored() {
    let answers = [
        a(&wire("evil.example"), [10, 0, 0, 1]),
        cname(&TO_QUESTION, "b.example.net"),
        cname(&wire("b.example.net"), "c.example.org"),
        record(&wire("c.example.org"), QType::A.code(), 3, &[10, 0, 0, 2]),
        a(&wire("c.example.org"), [8, 8, 8, 8]),
    ];
    let msg = reply(ID, NOERROR, "a.example.com", QType::A, &answers);
    assert_eq!(parse_response(ID, "a.example.com", QType::A, &msg).unwrap(), [IpAddr::from([8, 8, 8, 8])]);
    // Control: without the chain's first link, nothing is reached.
    let msg = reply(ID, NOERROR, "a.example.com", QType::A, &[answers[0].clone(), answers[4].clone()]);
    assert_eq!(parse_response(ID, "a.example.com", QType::A, &msg).unwrap(), Vec::<IpAddr>::new());
}

#[test]
fn cname_loops_and_long_chains_give_nothing() {
    let looped = [cname(&TO_QUESTION, "b.test"), cname(&wire("b.test"), "a.test"), a(&wire("c.test"), [8; 4])];
    let msg = reply(ID, NOERROR, "a.test", QType::A, &looped);
    assert_eq!(parse_response(ID, "a.test", QType::A, &msg).unwrap(), Vec::<IpAddr>::new());
    let mut chain: Vec<_> =
        (0..=MAX_CNAME_HOPS).map(|n| cname(&wire(&format!("n{n}.test")), &format!("n{}.test", n + 1))).collect();
    chain.push(a(&wire(&format!("n{}.test", MAX_CNAME_HOPS + 1)), [8; 4]));
    let msg = reply(ID, NOERROR, "n0.test", QType::A, &chain);
    assert_eq!(parse_response(ID, "n0.test", QType::A, &msg).unwrap(), Vec::<IpAddr>::new());
    // Control: one link shorter reaches the address.
    let msg = reply(ID, NOERROR, "n1.test", QType::A, &chain[1..]);
    assert_eq!(parse_response(ID, "n1.test", QType::A, &msg).unwrap(), [IpAddr::from([8; 4])]);
}

#[test]
fn compression_pointer_loop_is_malformed() {
    let mut msg = reply(ID, NOERROR, "a.test", QType::A, &[]);
    msg[7] = 1;
    let at = u8::try_from(msg.len()).unwrap();
    msg.extend(a(&[0xc0, at], [8; 4]));
    assert!(matches!(parse_response(ID, "a.test", QType::A, &msg), Err(DnsError::Malformed)));
}

#[test]
fn replies_to_other_queries_are_mismatches() {
    let good = reply(ID, NOERROR, "a.test", QType::A, &[a(&TO_QUESTION, [8; 4])]);
    let mut no_qr = good.clone();
    no_qr[2] &= 0x7f;
    let mut no_question = good.clone();
    no_question[5] = 0;
    for msg in [
        reply(ID + 1, NOERROR, "a.test", QType::A, &[a(&TO_QUESTION, [8; 4])]),
        reply(ID, NOERROR, "b.test", QType::A, &[a(&TO_QUESTION, [8; 4])]),
        reply(ID, NOERROR, "a.test", QType::Aaaa, &[]),
        no_qr,
        no_question,
    ] {
        assert!(matches!(parse_response(ID, "a.test", QType::A, &msg), Err(DnsError::Mismatch)));
    }
    assert!(parse_response(ID, "a.test", QType::A, &good).is_ok());
}

#[test]
fn truncated_packets_are_errors() {
    let msg = reply(ID, NOERROR, "a.test", QType::A, &[a(&TO_QUESTION, [8; 4])]);
    for len in 0..msg.len() {
        let result = parse_response(ID, "a.test", QType::A, &msg[..len]);
        assert!(matches!(result, Err(DnsError::Mismatch | DnsError::Malformed)), "{len}: {result:?}");
    }
    let bad_length = reply(ID, NOERROR, "a.test", QType::A, &[record(&TO_QUESTION, 1, CLASS_IN, &[8; 5])]);
    assert!(matches!(parse_response(ID, "a.test", QType::A, &bad_length), Err(DnsError::Malformed)));
}

#[test]
fn flags_and_rcodes() {
    let check = |flags| parse_response(ID, "a.test", QType::A, &reply(ID, flags, "a.test", QType::A, &[]));
    assert!(matches!(check(0x8380), Err(DnsError::Truncated)));
    assert!(matches!(check(0x8183), Err(DnsError::NoSuchName)));
    assert!(matches!(check(0x8182), Err(DnsError::Failed { rcode: 2 })));
    assert!(matches!(check(0x8185), Err(DnsError::Failed { rcode: 5 })));
    assert!(matches!(check(NOERROR), Ok(found) if found.is_empty()));
}

#[test]
fn names_are_checked_before_sending() {
    assert_eq!(encode_name("A.b.").unwrap(), b"\x01a\x01b\x00");
    let long_label = "a".repeat(64);
    let long_name = ["a"; 128].join(".");
    for name in ["", ".", "a..b", "a b", "a\u{e9}", &long_label, &long_name] {
        assert!(matches!(encode_name(name), Err(DnsError::InvalidName)), "{name:?}");
    }
    assert!(encode_name(&"a".repeat(63)).is_ok());
    assert!(encode_name(&["a"; 127].join(".")).is_ok());
}

#[tokio::test]
async fn resends_once_and_skips_replies_to_other_ids() {
    let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let address = server.local_addr().unwrap();
    let fake = tokio::spawn(async move {
        let mut buf = [0u8; 512];
        let (_, client) = server.recv_from(&mut buf).await.unwrap(); // Dropped, as if lost.
        let len = server.recv(&mut buf).await.unwrap();
        let id = u16::from_be_bytes([buf[0], buf[1]]);
        let answer = reply(id, NOERROR, "a.test", QType::A, &[a(&TO_QUESTION, [8; 4])]);
        assert_eq!(answer[12..answer.len() - 16], buf[12..len - 11], "the question");
        server.send_to(&reply(id ^ 1, NOERROR, "a.test", QType::A, &[]), client).await.unwrap();
        server.send_to(&answer, client).await.unwrap();
    });
    let found = query(address, "a.test", QType::A, Duration::from_secs(2)).await.unwrap();
    assert_eq!(found, [IpAddr::from([8; 4])]);
    fake.await.unwrap();
}

proptest! {
    #[test]
    fn any_bytes_parse_without_panic(msg in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = parse_response(ID, "a.test", QType::A, &msg);
    }

    #[test]
    fn any_records_after_a_matching_question_parse_without_panic(
        flags in any::<u16>(),
        ancount in any::<u8>(),
        tail in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let mut msg = reply(ID, flags | 0x8000, "a.test", QType::A, &[]);
        msg[7] = ancount;
        msg.extend(tail);
        let _ = parse_response(ID, "a.test", QType::A, &msg);
    }
}
