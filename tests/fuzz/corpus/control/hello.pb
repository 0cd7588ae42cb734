
( e634bf73febcf19b8332a9a461f99d8f€€@