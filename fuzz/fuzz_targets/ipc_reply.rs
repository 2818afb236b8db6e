//! The runtime's diagnostic IPC replies: any bytes a (hostile) process
//! writes on its diagnostic socket are read as one reply of at most the
//! size asked for, or refused, never a panic or a read past the declared
//! size; every payload decoder the client applies to a reply (ProcessInfo,
//! ProcessInfo2, a status HRESULT, a session id) gives a value or an error.
#![no_main]

use clrbpf_parse::ipc::{
    HEADER_LEN, MAX_MESSAGE_LEN, ReadFailure, ServerReply, parse_process_info, parse_process_info2,
    parse_session_id, parse_status, read_response,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the bound the client reads with (a status
    // reply's 24 bytes up to the protocol's 65 535).
    let Some((&bound, stream)) = data.split_first() else {
        return;
    };
    let max_len = (HEADER_LEN + usize::from(bound) * 257).min(MAX_MESSAGE_LEN);
    let mut reader = stream;
    let response = match read_response(&mut reader, max_len) {
        Ok(response) => response,
        Err(ReadFailure::Response(_)) => return,
        Err(ReadFailure::Io(error)) => panic!("a byte slice gave an i/o error: {error}"),
    };
    assert!(HEADER_LEN + response.payload.len() <= max_len);
    assert_eq!(response.payload.len(), response.header.payload_len());
    assert_eq!(
        stream.len() - reader.len(),
        usize::from(response.header.size),
        "read exactly the declared size"
    );
    // The payload decoders see the payload of any reply, OK or not.
    let payload = response.payload.clone();
    if let Ok(info) = parse_process_info(&payload) {
        assert!(info.clr_product_version.is_none());
    }
    if let Ok(info) = parse_process_info2(&payload) {
        let _ = info.runtime_major();
    }
    let Ok(reply) = response.into_reply() else {
        return;
    };
    let _ = parse_status(reply.clone());
    if let (Ok(id), ServerReply::Ok(bytes)) = (parse_session_id(reply.clone()), &reply) {
        assert_eq!(bytes.len(), 8);
        assert_eq!(id.to_le_bytes().as_slice(), bytes.as_slice());
    }
});
