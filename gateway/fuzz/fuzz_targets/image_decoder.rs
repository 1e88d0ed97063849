#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmgate::fuzzing::image_decoder(data));
